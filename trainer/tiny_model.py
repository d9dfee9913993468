"""Build a tiny causal LM of one of the model families (a Qwen2 by default) and its tokenizer, offline and
deterministically.

No model hub is reachable on the machines primerl is developed on, so the demo and the tests use a model that
primerl makes itself: a byte-level BPE tokenizer trained with ``tokenizers`` on a generated corpus (ChatML chat
samples of English words, digits, punctuation and short strings over a small alphabet), and a randomly
initialised ``Qwen2ForCausalLM`` of well under a million parameters by default. With ``num_experts > 0`` the
model is a ``Qwen3MoeForCausalLM`` instead (every layer a sparse MoE block of ``num_experts`` experts of size
``moe_intermediate_size``, top-``num_experts_per_tok`` routing, the router's load-balancing loss switched on with
``output_router_logits``), with the same tokenizer. ``family`` picks another architecture of
``primerl.trainer.tiny_families`` (Llama, Gemma 2/3, Phi-3, Mixtral, ...) with its config quirks and a chat
template of its shape; its turn markers are added to the trained tokenizer as special tokens. vLLM loads the result
like any Hugging Face checkpoint. The same spec gives byte-identical files; the tokenizer does not depend on the
seed, so models built with different seeds share it, and the default spec's files do not name a family.

    build_tiny_model("runs/demo/tiny-model", TinyModelSpec(seed=0))
    build_tiny_model("runs/gemma2", TinyModelSpec(family="gemma2"))
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from primerl.trainer.tiny_chat_formats import ChatFormat
from primerl.trainer.tiny_families import DEFAULT_FAMILY, DEFAULT_MOE_FAMILY, ModelFamily, get_family

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# vLLM's CPU attention backend supports only these head sizes; a checkpoint with another one loads in
# transformers but fails when the vLLM engine starts.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

TOKENIZER_VOCAB_SIZE = 1024
"""Vocabulary of the trained tokenizer, special tokens included (256 byte tokens, 3 special, the rest merges)."""

MOE_EXPERT_SIZE_MULTIPLE = 32
"""vLLM's CPU MoE kernel serves other expert sizes but crashes when their weights are reloaded in flight."""


VOCAB_MULTIPLE = 64
"""The model's vocabulary (embedding rows) is the tokenizer's size rounded up to a multiple of this."""

# Qwen2's pre-tokenizer: words with their leading space, single digits, punctuation runs, newlines.
_QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2-style ChatML template without a default system message (the default family's). Tokens after the prompt
# are what the model must produce; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = get_family(DEFAULT_FAMILY).chat.template

SPEC_FILE = "primerl_tiny_model.json"
"""Written last into a built model: the spec it was built from."""

_CORPUS_SEED = 1234  # fixed: the tokenizer is the same for every model seed
_CORPUS_NUM_SAMPLES = 6000
_TOY_ALPHABET = "abcdefgh"

_WORDS = """
a an the and or but if then else when while for to of in on at by with from up down over under into out about
is are was were be been am do does did have has had will would can could should may might must shall not no yes
i you he she it we they me him her us them my your his its our their this that these those here there what which
who whom whose where why how all any some many much more most few less least each every both either neither one
two three four five six seven eight nine ten hundred thousand first second last next new old good bad big small
long short high low hot cold fast slow early late right left true false same other own only just also very too
so again once still never always often sometimes now today tomorrow yesterday time day night week year hour
minute word letter string number list answer question reverse reversed order back front start end character
text sentence name thing way man woman child people world life hand part place case point group problem fact
water food house room door window book story game rule task step example output input result value line
make made take took give gave get got go went come came see saw know knew think thought say said tell told
ask asked use used find found want need try tried call called work worked seem feel leave put mean keep let
begin show hear play run move live believe write wrote read sit stand lose pay meet include continue set learn
change lead understand watch follow stop create speak allow add spend grow open walk win offer remember love
consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell
require report decide pull please thank thanks hello sure sorry okay assistant user system helpful correct wrong
red blue green black white yellow cat dog bird fish tree sun moon star sky sea river road city car boat
""".split()

_USER_TEMPLATES = (
    "Reverse the string: {s}",
    "Reverse this text: {s}",
    "What is {s} reversed?",
    "Write {s} backwards.",
    "Please reverse {s}.",
    "Repeat the word {w}.",
    "How many letters are in {w}?",
    "What is {n} plus {m}?",
    "Count from {n} to {m}.",
    "Say something about the {w}.",
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer with the reversed string only.",
    "Think step by step, then answer.",
)


@dataclass
class TinyModelSpec:
    """Shape of the tiny model. `None` sizes are derived: intermediate = 4 x hidden, vocab = tokenizer size
    rounded up to a multiple of 64. ``family`` (``tiny_families``) None: a dense Qwen2 with ``num_experts = 0``,
    a Qwen3-MoE with ``> 0``; an MoE family needs ``num_experts > 0``, a dense one 0."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    family: str | None = None

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = self.implied_family

    @property
    def implied_family(self) -> str:
        """The family of a spec that names none (and of every spec file written before families existed)."""
        return DEFAULT_MOE_FAMILY if self.num_experts > 0 else DEFAULT_FAMILY

    @property
    def model_family(self) -> ModelFamily:
        return get_family(self.family)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def validate(self, family: ModelFamily | None = None) -> None:
        """Raise ValueError with a fix-it message for a shape that transformers or vLLM cannot run."""
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for name in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = {self.hidden_size}/{self.num_attention_heads} "
                f"= {self.head_dim}, but vLLM's CPU attention supports only head_dim in "
                f"{list(SUPPORTED_HEAD_DIMS)}; e.g. hidden_size={32 * self.num_attention_heads} for "
                f"{self.num_attention_heads} heads"
            )
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: a dense model), got {self.num_experts}")
        family = family or self.model_family  # ValueError listing the valid names
        if family.moe and not self.is_moe:
            raise ValueError(f"family {family.name!r} is a mixture of experts: num_experts must be >= 1")
        if self.is_moe and not family.moe:
            raise ValueError(
                f"family {family.name!r} is dense: num_experts must be 0 (got {self.num_experts}); "
                f"for a mixture of experts use {DEFAULT_MOE_FAMILY} or another MoE family"
            )
        if self.is_moe:
            self._validate_moe()
        if self.vocab_size is not None and self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be >= the tokenizer's {TOKENIZER_VOCAB_SIZE} tokens")

    def _validate_moe(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                f"({self.num_experts})"
            )
        size = self.moe_intermediate_size
        if size < 1 or size % MOE_EXPERT_SIZE_MULTIPLE:
            raise ValueError(
                f"moe_intermediate_size (expert size) = {size} must be a positive multiple of "
                f"{MOE_EXPERT_SIZE_MULTIPLE}: vLLM's CPU MoE kernel serves other sizes but crashes when the "
                f"experts' weights are updated in flight, leaving the engine broken; e.g. --expert-size "
                f"{max(MOE_EXPERT_SIZE_MULTIPLE, size // MOE_EXPERT_SIZE_MULTIPLE * MOE_EXPERT_SIZE_MULTIPLE)}"
            )

    def to_json_dict(self) -> dict[str, Any]:
        """The spec as SPEC_FILE stores it; a dense spec leaves out the MoE fields and a spec of its implied
        family leaves out the family (the files of the default and `--moe` builds are unchanged)."""
        out = asdict(self)
        if self.family == self.implied_family:
            out.pop("family")
        if not self.is_moe:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                out.pop(name)
        return out


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    spec: TinyModelSpec | None = None,
    *,
    overwrite: bool = False,
    family: ModelFamily | None = None,
) -> Path:
    """Write tokenizer, config, weights and generation config of a tiny model (`spec.family`) to `out_dir`.

    The files are written to a temporary directory next to `out_dir` and renamed into place, so `out_dir`
    either holds a complete model or is left as it was. A non-empty `out_dir` is an error unless `overwrite`.
    `family`: a shape to build instead of `spec.family`'s (a refused family's `tiny_families.RefusedFamily.shape`,
    to measure it again).
    """
    spec = spec or TinyModelSpec()
    family = family or spec.model_family
    spec.validate(family)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer = _save_tokenizer(tmp_dir, family.chat)
        _save_model(tmp_dir, spec, family, tokenizer)
        (tmp_dir / SPEC_FILE).write_text(
            json.dumps({"spec": spec.to_json_dict(), "tokenizer_vocab_size": len(tokenizer)}, indent=2, sort_keys=True)
            + "\n"
        )
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def read_spec(model_dir: str | os.PathLike[str]) -> TinyModelSpec | None:
    """The spec a directory was built from by `build_tiny_model`, or None if it holds no tiny model."""
    path = Path(model_dir) / SPEC_FILE
    if not path.is_file():
        return None
    try:
        return TinyModelSpec(**json.loads(path.read_text())["spec"])
    except (ValueError, KeyError, TypeError):
        return None


def count_parameters(model_dir: str | os.PathLike[str]) -> int:
    """Number of stored parameters (tied embeddings counted once) of a safetensors checkpoint."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                total += numel
    return total


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first and removed after."""
    # mkdtemp makes a 0700 directory and transformers writes safetensors as 0600: give the model the modes of
    # an ordinary checkout so other users and containers can read it.
    os.chmod(src, 0o755)
    for path in src.iterdir():
        os.chmod(path, 0o644)
    if not dst.exists():
        os.rename(src, dst)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.rename(dst, trash / dst.name)
    os.rename(src, dst)
    shutil.rmtree(trash)


def generate_corpus(num_samples: int = _CORPUS_NUM_SAMPLES, seed: int = _CORPUS_SEED) -> list[str]:
    """ChatML-formatted training text for the tokenizer: chats about words, numbers and short strings."""
    rng = random.Random(seed)
    corpus: list[str] = []
    for _ in range(num_samples):
        letters = [rng.choice(_TOY_ALPHABET) for _ in range(rng.randint(3, 10))]
        # Toy strings appear plain ("cabd"), spaced ("c a b d") and as digits ("3 1 4"): spaced letters and
        # digits are always one token per character, which keeps the reversal task learnable.
        style = rng.randrange(3)
        if style == 0:
            s = "".join(letters)
        elif style == 1:
            s = " ".join(letters)
        else:
            s = "".join(str(rng.randint(0, 9)) for _ in letters)
        w = rng.choice(_WORDS)
        n, m = rng.randint(0, 999), rng.randint(0, 999)
        user = rng.choice(_USER_TEMPLATES).format(s=s, w=w, n=n, m=m)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:")
        answer = s[::-1] if ("everse" in user or "backwards" in user) else f"{sentence} {n + m}"
        parts = []
        if rng.random() < 0.5:
            parts.append(f"{IM_START}system\n{rng.choice(_SYSTEM_PROMPTS)}{IM_END}\n")
        parts.append(f"{IM_START}user\n{user}{IM_END}\n")
        parts.append(f"{IM_START}assistant\n{answer}{IM_END}\n")
        corpus.append("".join(parts))
        corpus.append(sentence)
    return corpus


def train_tokenizer() -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with Qwen2's pre-tokenizer, trained on `generate_corpus()`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer=trainer)
    return tokenizer


def _save_tokenizer(out_dir: Path, chat: ChatFormat) -> Any:
    """Save the trained BPE as a transformers `Qwen2Tokenizer` (what AutoTokenizer and vLLM load for a qwen2
    model anyway: transformers 5 rebuilds a Qwen2 tokenizer's pipeline from its vocab and merges; other families
    load it too, as tokenizer_config.json names its class), with `chat`'s template and its turn markers added as
    special tokens after the trained ones."""
    from transformers import Qwen2Tokenizer

    trained = json.loads(train_tokenizer().to_str())
    vocab = {token: token_id for token, token_id in trained["model"]["vocab"].items()}
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in trained["model"]["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=chat.eos_token,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=chat.bos_token,
        extra_special_tokens=[
            token for token in (*SPECIAL_TOKENS, *chat.added_tokens) if token not in (chat.eos_token, ENDOFTEXT)
        ],
        model_max_length=TinyModelSpec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        chat_template=chat.template,
    )
    expected = TOKENIZER_VOCAB_SIZE + len(set(chat.added_tokens) - set(SPECIAL_TOKENS))
    if len(tokenizer) != expected:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens, expected {expected}")
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _model_config(
    spec: TinyModelSpec, family: ModelFamily, vocab_size: int, eos_id: int, pad_id: int, bos_id: int
) -> Any:
    """The shape every family shares, then the family's own arguments (which win: an MoE family's expert size,
    untied embeddings, its rope)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if family.initializer_range is not None:
        common["initializer_range"] = family.initializer_range
    return getattr(transformers, family.config_class)(**{**common, **family.config(spec)})


def _save_model(out_dir: Path, spec: TinyModelSpec, family: ModelFamily, tokenizer: Any) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    vocab_size = spec.vocab_size or -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    bos_id = pad_id if tokenizer.bos_token is None else tokenizer.convert_tokens_to_ids(tokenizer.bos_token)
    config = _model_config(spec, family, vocab_size, eos_id, pad_id, bos_id)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG state
        torch.manual_seed(spec.seed)
        model = getattr(transformers, family.architecture)(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    from transformers.utils import logging as hf_logging

    progress_bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: "Writing model shards 100%" is noise
    try:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    finally:
        if progress_bar_was_enabled:
            hf_logging.enable_progress_bar()

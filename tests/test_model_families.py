"""The model families of `primerl init-tiny-model --family` through the real path: each tiny build keeps its family's
quirks, a real vLLM engine serves it with logprobs that match a transformers float32 pass, and after a FULL update
in flight (weights changed by real AdamW steps, exported by the trainer's `hf_state_dict`, applied by
`PolicyUpdater`), then a DELTA update on top of it (more steps, XOR-zlib against the FULL one), then a LORA update
(an adapter on the family's usual target modules, trained by AdamW steps, exported as the trainer publishes it), the
served logprobs match transformers (peft for the adapter) with the new weights. An MoE family is not served with
LoRA by vLLM's CPU build: the config check refuses that with its line (`configs.lora_support`). A family this
machine cannot serve is refused by the preflight with one line. One engine per family (~4-12 s each on 2 cores).

`PRIMERL_FAMILY_TABLE=docs/models.md pytest tests/test_model_families.py` rewrites the measured table in that file
from this run's results (between its `family-table` markers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from support.engines import engine_for_test

from primerl.cli import tiny_model as tiny_model_cli
from primerl.trainer.sft_data import tokenize_conversation
from primerl.trainer.tiny_families import DEFAULT_FAMILY, FAMILIES, LOGPROB_TOLERANCE, REFUSED, family_names
from primerl.trainer.tiny_model import ENDOFTEXT, SPEC_FILE, TinyModelSpec, build_tiny_model, read_spec

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning")

PROMPTS = ["Reverse the string: a b c d", "What is 12 plus 30?", "hello", "Count from 1 to 5."]
MAX_TOKENS = 12
"""Prompts of 3-10 tokens plus 12 sampled ones: longer than the sliding window (8) of the families that have one."""
NUM_TRAIN_STEPS = 3
LORA_RANK = 8
LORA_LEARNING_RATE = 1e-2
LEARNING_RATE = 2e-3
MIN_UPDATE_EFFECT = 0.1
"""After the update, the old weights' logprobs must be at least this far from the served ones: the update took."""
TABLE_ENV = "PRIMERL_FAMILY_TABLE"
TABLE_BEGIN, TABLE_END = "<!-- family-table:begin -->", "<!-- family-table:end -->"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"

RESULTS: dict[str, dict[str, Any]] = {}
"""family -> what `test_family_serves_and_follows_a_full_update` measured (written to the docs table at the end)."""
RUN_RESULTS: dict[str, float] = {}
"""family -> seconds `test_sft_then_rl_through_primerl` took (SFT and a 2-step RL run)."""
REFUSED_RESULTS: dict[str, dict[str, Any]] = {}
"""refused family -> what `test_a_refused_family_still_fails_here` measured."""


def family_spec(name: str) -> TinyModelSpec:
    return TinyModelSpec(family=name, num_experts=8 if FAMILIES[name].moe else 0)


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


# ---- fast: builds, names, refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", family_names())
def test_each_family_builds_with_its_quirks_and_chat_shape(name: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    family = FAMILIES[name]
    spec = family_spec(name)
    model_dir = build_tiny_model(tmp_path / name, spec)
    config = json.loads((model_dir / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(model_dir)  # its attribute names: a family's own ones mapped
    assert config["architectures"] == [family.architecture]
    for key, value in family.config(spec).items():
        stored = getattr(loaded, key)
        if key == "rope_parameters":  # transformers adds its defaults to the rope dict (per layer type, or one)
            flat = value if "rope_type" in value else {f"{t}.{k}": v for t, p in value.items() for k, v in p.items()}
            stored_flat = (
                stored if "rope_type" in value else {f"{t}.{k}": v for t, p in stored.items() for k, v in p.items()}
            )
            assert {k: stored_flat.get(k) for k in flat} == flat
        else:
            assert stored == value, key
    assert read_spec(model_dir) == spec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse: a b c"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert "Be brief." in text and "Reverse: a b c" in text
    for marker in family.chat.added_tokens:  # the turn markers are single special tokens
        if marker in text:
            assert tokenizer.convert_tokens_to_ids(marker) in ids, marker
    assert tokenizer.eos_token == family.chat.eos_token
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["vocab_size"] >= len(tokenizer)
    # The byte-level BPE is the default family's: plain text encodes to the same ids.
    plain = "Reverse the string: a b c d, then count 1234 <|im_end|>"
    default = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "default", TinyModelSpec(seed=0)))
    assert tokenizer.encode(plain) == default.encode(plain)
    assert tokenizer.convert_tokens_to_ids(ENDOFTEXT) == default.convert_tokens_to_ids(ENDOFTEXT)

    # SFT trains on the assistant turns only, each with the family's end-of-turn token.
    chat = [
        {"role": "user", "content": "a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "d a"},
        {"role": "assistant", "content": "a d"},
    ]
    sample = tokenize_conversation(tokenizer, chat)
    loss_text = tokenizer.decode([t for t, keep in zip(sample.input_ids, sample.loss_mask, strict=True) if keep])
    eos = family.chat.eos_token
    assert loss_text.replace(eos, f"{eos} ").split() == ["c", "b", f"a{eos}", "a", f"d{eos}"], loss_text


def test_family_builds_are_deterministic_and_the_default_names_no_family(tmp_path: Path) -> None:
    spec = TinyModelSpec(family="gemma2", hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1)
    assert file_hashes(build_tiny_model(tmp_path / "a", spec)) == file_hashes(build_tiny_model(tmp_path / "b", spec))
    assert json.loads((tmp_path / "a" / SPEC_FILE).read_text())["spec"]["family"] == "gemma2"

    # The default and `--moe` specs write no family (their files are those of builds made before families).
    assert "family" not in TinyModelSpec().to_json_dict()
    assert "family" not in TinyModelSpec(num_experts=8).to_json_dict()
    assert TinyModelSpec(num_experts=8) == TinyModelSpec(num_experts=8, family="qwen3_moe")
    assert TinyModelSpec().family == DEFAULT_FAMILY


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"family": "gpt2"}, r"unknown model family 'gpt2'; valid: gemma2, gemma3, .*qwen3_moe"),
        ({"family": "gpt_oss", "num_experts": 8}, "cannot run on this machine: .*; use qwen3_moe or mixtral"),
        ({"family": "mixtral"}, "mixture of experts: num_experts must be >= 1"),
        ({"family": "llama", "num_experts": 8}, "is dense: num_experts must be 0"),
    ],
)
def test_bad_family_raises_a_clear_error(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path / "model", TinyModelSpec(**overrides))
    assert not (tmp_path / "model").exists()


def test_cli_builds_a_family_and_refuses_bad_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    small = ["--hidden", "64", "--heads", "2", "--kv-heads", "1", "--layers", "1"]
    assert tiny_model_cli.main([str(tmp_path / "phi3"), "--family", "phi3", *small]) == 0
    out = capsys.readouterr().out
    assert "family phi3 (Phi3ForCausalLM" in out and "fused qkv_proj" in out
    assert read_spec(tmp_path / "phi3").family == "phi3"
    assert tiny_model_cli.main([str(tmp_path / "phi3"), "--family", "phi3", *small]) == 0
    assert "nothing to do" in capsys.readouterr().out

    assert tiny_model_cli.main([str(tmp_path / "mixtral"), "--family", "mixtral", "--experts", "4", *small]) == 0
    assert read_spec(tmp_path / "mixtral").num_experts == 4
    capsys.readouterr()

    assert tiny_model_cli.main([str(tmp_path / "x"), "--family", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "unknown model family 'gpt2'" in err and ", ".join(family_names()) in err
    assert tiny_model_cli.main([str(tmp_path / "x"), "--family", "gpt_oss"]) == 2
    assert "cannot run on this machine" in capsys.readouterr().err
    assert tiny_model_cli.main([str(tmp_path / "x"), "--family", "llama", "--moe"]) == 2
    assert "dense family" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _checkpoint_dir(path: Path, architecture: str) -> Path:
    """A directory the preflight takes for a model: a config.json naming `architecture` and a weights file."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_preflight_refuses_a_family_this_machine_cannot_serve_in_one_line(name: str, tmp_path: Path) -> None:
    from primerl.cli.preflight.model import model_checks
    from primerl.supervisor.role_configs import has_gpus

    refused = REFUSED[name]
    model = _checkpoint_dir(tmp_path / name, refused.architecture)
    served = _checkpoint_dir(tmp_path / "served", FAMILIES["mixtral"].architecture)
    findings = model_checks({"inference.model.name": (str(model), "model")})()
    assert model_checks({"inference.model.name": (str(served), "model")})() == []
    if has_gpus():  # the refusals were measured on vLLM's CPU build
        assert findings == []
        return
    [finding] = findings
    assert finding.error
    line = finding.message
    assert "\n" not in line
    assert line.startswith(f"inference.model.name = {str(model)!r}: model family {name!r} ({refused.architecture})")
    assert f"cannot run on this machine: {refused.reason}; use {refused.use_instead}" in line


@pytest.mark.parametrize("name", family_names())
def test_the_trainer_steps_each_family_and_publishes_the_checkpoint_names(name: str, tmp_path: Path) -> None:
    """The trainer's side (no engine): `load_model` and one RL step of `TrainStep` on packed samples, full and with
    LoRA on the family's usual target modules; `hf_state_dict` publishes the checkpoint's names and shapes (what
    vLLM loads). A LoRA config naming modules the family lacks is refused when the trainer loads the model."""
    import torch
    from safetensors.torch import load_file
    from support.trainer_runs import packed, samples

    from primerl.configs.trainer import DefaultLossConfig, LoRAConfig, ModelConfig
    from primerl.trainer.batch import MicroBatch
    from primerl.trainer.distributed import DistInfo
    from primerl.trainer.hf_state_dict import hf_state_dict, lora_state_dict
    from primerl.trainer.model import load_model
    from primerl.trainer.train_step import TrainStep, rl_objective

    family = FAMILIES[name]
    moe = {"num_experts": 4, "moe_intermediate_size": 32} if family.moe else {}
    spec = TinyModelSpec(family=name, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, **moe)
    model_dir = build_tiny_model(tmp_path / name, spec)
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    batch = MicroBatch.from_tensors(packed(samples(0)[:4]))

    def step(model: torch.nn.Module) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        objective = rl_objective(DefaultLossConfig())
        return (
            TrainStep(model, optimizer, scheduler, objective, DistInfo(0, 1, 0, None), max_grad_norm=1.0)
            .step(1, [batch])
            .loss
        )

    full = load_model(ModelConfig(name=str(model_dir)))
    assert torch.isfinite(torch.tensor(step(full)))
    published = hf_state_dict(full)
    assert {n: tuple(t.shape) for n, t in published.items()} == {n: tuple(t.shape) for n, t in checkpoint.items()}
    assert sum(not torch.equal(published[n].float(), checkpoint[n]) for n in checkpoint) >= len(checkpoint) // 2

    targets = list(family.lora_target_modules)
    lora = load_model(ModelConfig(name=str(model_dir), lora=LoRAConfig(rank=4, alpha=8, target_modules=targets)))
    assert torch.isfinite(torch.tensor(step(lora)))
    adapter = lora_state_dict(lora)
    assert {target for target in targets if any(f".{target}.lora_B" in n for n in adapter)} == set(targets)
    merged = hf_state_dict(lora)
    assert set(merged) == set(checkpoint)
    if set(targets) != set(LoRAConfig().target_modules):  # Phi-3's fused names, an MoE's attention only
        with pytest.raises(ValueError, match="match no module"):
            load_model(ModelConfig(name=str(model_dir), lora=LoRAConfig()))


@pytest.mark.parametrize("name", ["phi3", "mixtral"])
def test_preflight_refuses_lora_targets_the_family_lacks(name: str, tmp_path: Path) -> None:
    """`primerl rl` with the default LoRA targets on Phi-3 (fused projections) or an MoE: refused beside the start
    with the trainer's own message, instead of the trainer failing after the start; the family's list passes."""
    from support.rl_configs import BASE, config_writer, load

    from primerl.cli.preflight.base import run_checks
    from primerl.cli.preflight.roles import BESIDE_THE_START, rl_checks

    family = FAMILIES[name]
    moe = {"num_experts": 4, "moe_intermediate_size": 32} if family.moe else {}
    spec = TinyModelSpec(family=name, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, **moe)
    model = str(build_tiny_model(tmp_path / name, spec))
    # An MoE's LoRA is trained and published merged: vLLM's CPU build serves no LoRA on it (configs.lora_support).
    base = BASE + ('\n[inference]\nenable_lora = false\n[trainer.weight_broadcast]\ntype = "full"\n' if moe else "")
    write = config_writer(tmp_path)

    def lora_findings(lora_table: str) -> list[Any]:
        checks = rl_checks(load("@", write("rl.toml", base + lora_table), "--model.name", model))
        assert "lora_targets" in BESIDE_THE_START
        return run_checks({"lora_targets": checks["lora_targets"]}).findings

    [finding] = lora_findings("\n[trainer.model.lora]\nrank = 4\n")
    assert finding.error and finding.message.startswith("trainer.model.lora.target_modules: lora.target_modules [")
    assert "match no module" in finding.message and "gate_proj" in finding.message
    targets = ", ".join(f'"{t}"' for t in family.lora_target_modules)
    assert lora_findings(f"\n[trainer.model.lora]\nrank = 4\ntarget_modules = [{targets}]\n") == []
    assert "lora_targets" not in rl_checks(load("@", write("full.toml", base), "--model.name", model))


# ---- slow: one real engine per family ---------------------------------------------------------------------------


def _engine_options(model_dir: Path, work_dir: Path, *, in_process: bool, lora: bool) -> Any:
    from primerl.inference.engine import EngineOptions
    from primerl.inference.worker_extension import WORKER_EXTENSION_CLS

    return EngineOptions(
        model=model_dir,
        in_process=in_process,
        work_dir=work_dir,
        seed=0,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        enable_lora=lora,
        max_lora_rank=LORA_RANK,
    )


def _served_gap(llm: Any, reference: Any, lora_request: Any = None) -> tuple[float, Any]:
    from primerl.inference.logprob_check import check_logprobs, generate_with_logprobs

    result = generate_with_logprobs(
        llm, PROMPTS, max_tokens=MAX_TOKENS, seed=0, temperature=1.0, ignore_eos=True, lora_request=lora_request
    )
    gap = check_logprobs(reference, result.samples, logprobs_mode="processed_logprobs", temperature=1.0)
    return gap, result.samples


def _sequences(samples: Any) -> list[list[int]]:
    return [sample.prompt_token_ids + sample.completion_token_ids for sample in samples]


def _train(model: Any, sequences: list[list[int]], lr: float = LEARNING_RATE) -> None:
    """A few real AdamW steps of next-token loss on `sequences` (MoE: plus the router's aux loss)."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(NUM_TRAIN_STEPS):
        for sequence in sequences:
            ids = torch.tensor([sequence])
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", family_names())
def test_family_serves_and_follows_a_full_update(name: str, tmp_path: Path) -> None:
    from support.policy_updates import delta_update, full_update, lora_update

    from primerl.configs.lora_support import moe_lora_problem, vllm_is_cpu_build
    from primerl.inference.logprob_check import check_logprobs, load_reference_model
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.inference.vllm_plugin import START_METHOD_ENV
    from primerl.trainer.hf_state_dict import hf_state_dict

    family = FAMILIES[name]
    started_s = time.monotonic()
    model_dir = build_tiny_model(tmp_path / name, family_spec(name))
    # Both before the engine: a family vLLM serves through its Transformers backend patches transformers' class.
    reference, before = load_reference_model(model_dir), load_reference_model(model_dir)
    # Spawned: an engine core forked from this process, after in-process engines ran in it, hangs.
    env = {START_METHOD_ENV: "spawn"} if family.engine_in_own_process else {}
    lora_refusal = moe_lora_problem(model_dir)
    assert (lora_refusal is not None) == (family.moe and vllm_is_cpu_build()), lora_refusal
    options = _engine_options(
        model_dir, tmp_path / "work", in_process=not family.engine_in_own_process, lora=lora_refusal is None
    )
    with engine_for_test(options, env) as llm:
        gap, samples = _served_gap(llm, reference)
        _train(reference, _sequences(samples))
        weights = _exported(hf_state_dict(reference))
        updater = PolicyUpdater.for_llm(llm, tmp_path / "policy", staging_dir=tmp_path)
        updater.prepare()
        updater.apply(*full_update(weights, 1))
        full_gap, samples_after = _served_gap(llm, reference)
        effect = check_logprobs(before, samples_after, logprobs_mode="processed_logprobs", temperature=1.0)

        _train(reference, _sequences(samples_after))
        delta_weights = _exported(hf_state_dict(reference))
        header, payload = delta_update(delta_weights, weights, 2, 1)
        assert len(header.tensors) == len(weights)  # an optimizer step changes every tensor
        updater.apply(header, payload)
        delta_gap, samples_delta = _served_gap(llm, reference)

        lora_gap = None
        if lora_refusal is None:
            adapter = _trained_adapter(reference, samples_delta, family.lora_target_modules, tmp_path / "adapter")
            updater.apply(*lora_update(tmp_path / "adapter", 3))
            lora_gap, samples_lora = _served_gap(llm, adapter, updater.lora_request())
            lora_effect = check_logprobs(reference, samples_lora, logprobs_mode="processed_logprobs", temperature=1.0)
            assert lora_effect >= MIN_UPDATE_EFFECT, f"{name}: the adapter changed the logprobs by {lora_effect:.3g}"
    seconds = time.monotonic() - started_s
    RESULTS[name] = {"gap": gap, "full_gap": full_gap, "delta_gap": delta_gap, "lora_gap": lora_gap, "seconds": seconds}
    lora = "refused (MoE on CPU)" if lora_gap is None else f"{lora_gap:.2e}"
    print(
        f"\n{name}: max |vLLM - transformers fp32| logprob {gap:.2e}, after a FULL update {full_gap:.2e}, "
        f"after a DELTA update {delta_gap:.2e}, after a LORA update {lora} ({seconds:.1f} s)"
    )
    assert gap <= family.logprob_tolerance, f"{name}: served logprobs {gap:.3g} off transformers'"
    assert effect >= MIN_UPDATE_EFFECT, f"{name}: the update changed the served logprobs by only {effect:.3g}"
    assert full_gap <= family.logprob_tolerance, f"{name}: after a FULL update {full_gap:.3g} off transformers'"
    assert delta_gap <= family.logprob_tolerance, f"{name}: after a DELTA update {delta_gap:.3g} off transformers'"
    assert lora_gap is None or lora_gap <= family.logprob_tolerance, f"{name}: after a LORA update {lora_gap:.3g} off"


def _trained_adapter(reference: Any, samples: Any, targets: tuple[str, ...], out_dir: Path) -> Any:
    """A LoRA adapter on a copy of `reference` (peft's init: B = 0), trained by AdamW steps towards seeded random
    completions of the samples' prompts (so that it moves the policy), written as the trainer publishes it
    (`lora_state_dict`, `lora_adapter_config_json`); returns the peft model, for reference logprobs."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from primerl.trainer.hf_state_dict import SAFETENSORS_METADATA, lora_adapter_config_json, lora_state_dict

    torch.manual_seed(0)
    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(reference), config)
    generator = torch.Generator().manual_seed(0)
    targets_ids = [
        s.prompt_token_ids + torch.randint(0, 1000, (MAX_TOKENS,), generator=generator).tolist() for s in samples
    ]
    _train(model, targets_ids, lr=LORA_LEARNING_RATE)
    out_dir.mkdir()
    save_file(lora_state_dict(model), str(out_dir / "adapter_model.safetensors"), metadata=SAFETENSORS_METADATA)
    (out_dir / "adapter_config.json").write_text(lora_adapter_config_json(model))
    return model


def _exported(state: dict[str, Any]) -> dict[str, Any]:
    """The trainer's export, copied (its tensors are views of parameters the next step changes)."""
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_family_still_fails_here(name: str, tmp_path: Path) -> None:
    """The shape each refusal was measured on, measured again: served logprobs off transformers', or after a FULL
    update of trained weights. When vLLM serves it right, this fails: move it to FAMILIES."""
    from support.policy_updates import full_update

    from primerl.inference.logprob_check import load_reference_model
    from primerl.inference.policy_updates import PolicyUpdater
    from primerl.trainer.hf_state_dict import hf_state_dict

    shape = REFUSED[name].shape
    started_s = time.monotonic()
    model_dir = build_tiny_model(tmp_path / name, TinyModelSpec(family=name, num_experts=8), family=shape)
    reference = load_reference_model(model_dir)
    with engine_for_test(_engine_options(model_dir, tmp_path / "work", in_process=True, lora=False)) as llm:
        gap, samples = _served_gap(llm, reference)
        _train(reference, _sequences(samples))
        updater = PolicyUpdater.for_llm(llm, tmp_path / "policy", staging_dir=tmp_path)
        updater.prepare()
        updater.apply(*full_update(_exported(hf_state_dict(reference)), 1))
        reload_gap, _ = _served_gap(llm, reference)
    seconds = time.monotonic() - started_s
    REFUSED_RESULTS[name] = {"gap": gap, "reload_gap": reload_gap, "seconds": seconds}
    print(f"\n{name} (refused): served {gap:.2e} off, after a FULL update of trained weights {reload_gap:.2e}")
    assert max(gap, reload_gap) > LOGPROB_TOLERANCE, f"vLLM serves {name} right now: move it from REFUSED to FAMILIES"


RUN_FAMILIES = tuple(name for name in family_names() if name != DEFAULT_FAMILY)
"""`primerl sft` then `primerl rl` on every served family but the demo's Qwen2 (tests/test_sft.py and
tests/test_rl_launcher.py train that one with each)."""
SFT_WORDS = ("abc", "bad", "cafe", "deed", "face", "head", "bead", "dace")
SFT_BATCH_SIZE = 4
"""8 chat samples in batches of 4: 2 SFT steps."""
RL_STEPS = 2
RL_WITH_LORA = "phi3"
"""The family whose RL trains a LoRA adapter on its usual target modules (Phi-3's fused `qkv_proj` and
`gate_up_proj`), through `[trainer.model.lora]` of examples/reverse_text_rl_lora.toml; the others train every
weight (examples/reverse_text_rl.toml)."""
RL_SMALL = ["--orchestrator.batch-size", "16", "--orchestrator.rollouts-per-example", "4"]
RL_SMALL += ["--orchestrator.sampling.max-tokens", "16", "--no-dashboard"]
"""The example's run made small (4 prompts x 4 rollouts of at most 16 tokens a step): the start-up of the four
roles, not the steps, is what each family's run costs."""


def _primerl_env() -> dict[str, str]:
    """The environment of a `primerl` command run by a test: offline, the env-worker interpreter, no run token."""
    repo = Path(__file__).resolve().parent.parent
    env_python = os.environ.get("PRIMERL_ENV_PYTHON", str(repo / ".venv-envs" / "bin" / "python"))
    if not Path(env_python).exists():
        pytest.skip(f"no env-worker interpreter at {env_python}: run `make setup` (it builds .venv-envs)")
    env = {**os.environ, "PRIMERL_ENV_PYTHON": env_python, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PRIMERL_RUN_TOKEN", None)
    return env


def _sft_export(model_dir: Path, tmp_path: Path, env: dict[str, str]) -> Path:
    """`primerl sft` on chat samples rendered with the family's template; the export of its last step."""
    import subprocess
    import sys

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": f"Reverse the string: {' '.join(word)}"}],
                    "completion": [{"role": "assistant", "content": " ".join(reversed(word))}],
                }
            )
            + "\n"
            for word in SFT_WORDS
        )
    )
    sft_dir = tmp_path / "sft"
    sft = [str(Path(sys.executable).parent / "primerl"), "sft", "--model.name", str(model_dir)]
    sft += ["--data.path", str(data), "--data.batch-size", str(SFT_BATCH_SIZE), "--data.epochs", "1"]
    sft += ["--seq-len", "256", "--output-dir", str(sft_dir)]
    result = subprocess.run(sft, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [export] = sorted((sft_dir / "weights").glob("step_*"))
    assert export.name == f"step_{len(SFT_WORDS) // SFT_BATCH_SIZE}", export  # every batch trained
    assert (export / "STABLE").exists()
    return export


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", RUN_FAMILIES)
def test_sft_then_rl_through_primerl(name: str, tmp_path: Path) -> None:
    """`primerl sft` on chat samples rendered with the family's template, then 2 RL steps of `primerl rl` from
    the SFT export (broker, vLLM inference, orchestrator, trainer), with LoRA for `RL_WITH_LORA`: every step
    trained and served."""
    import subprocess
    import sys

    from support.probes import free_port

    started_s = time.monotonic()
    env = _primerl_env()
    export = _sft_export(build_tiny_model(tmp_path / name, family_spec(name)), tmp_path, env)
    run_dir, repo = tmp_path / "run", Path(__file__).resolve().parent.parent
    config = "reverse_text_rl_lora.toml" if name == RL_WITH_LORA else "reverse_text_rl.toml"
    rl = [str(Path(sys.executable).parent / "primerl"), "rl", "@", str(repo / "examples" / config)]
    rl += ["--model.name", str(export), "--output-dir", str(run_dir), "--max-steps", str(RL_STEPS)]
    rl += ["--broker.grpc-port", str(free_port()), *RL_SMALL]
    if name == RL_WITH_LORA:
        rl += ["--trainer.model.lora.target-modules", json.dumps(list(FAMILIES[name].lora_target_modules))]
    result = subprocess.run(rl, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert f"run finished: {RL_STEPS} steps" in result.stdout, output[-6000:]
    served = f"policy version served by inference: {RL_STEPS} (trainer published {RL_STEPS})"
    assert served in result.stdout, output[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["role"] == "trainer"] == list(range(1, RL_STEPS + 1))
    if name == RL_WITH_LORA:  # inference was sent adapters, not weights
        assert "kind=WEIGHT_UPDATE_KIND_LORA" in (run_dir / "logs" / "inference.log").read_text()
    RUN_RESULTS[name] = time.monotonic() - started_s


# ---- the docs table ---------------------------------------------------------------------------------------------


def family_table(
    results: dict[str, dict[str, Any]], run_results: dict[str, float], refused_results: dict[str, dict[str, Any]]
) -> str:
    """The markdown table of docs/models.md: every family, measured (from `results`) or refused."""
    rows = [
        "| family | architecture | stands for | served | logprob gap | FULL update gap | DELTA update gap "
        "| LORA update gap | SFT + RL (`primerl`) | tolerance | quirks kept | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in family_names():
        family, measured = FAMILIES[name], results.get(name)
        gap = f"{measured['gap']:.1e}" if measured else "not measured"
        full = f"{measured['full_gap']:.1e}" if measured else "not measured"
        delta = f"{measured['delta_gap']:.1e}" if measured else "not measured"
        lora = "not measured"
        if measured:
            lora = "refused on CPU (MoE)" if measured["lora_gap"] is None else f"{measured['lora_gap']:.1e}"
        lora += f" ({', '.join(family.lora_target_modules)})"
        run = "not run"
        if name in run_results:
            run = (
                f"yes, RL with LoRA ({run_results[name]:.0f} s)"
                if name == RL_WITH_LORA
                else f"yes ({run_results[name]:.0f} s)"
            )
        elif name == DEFAULT_FAMILY:
            run = "yes (tests/test_sft.py, tests/test_rl_launcher.py)"
        served = "yes" if measured and measured["gap"] <= family.logprob_tolerance else "no"
        rows.append(
            f"| `{name}` | {family.architecture} | {family.checkpoints} | {served} | {gap} | {full} | {delta} "
            f"| {lora} | {run} | {family.logprob_tolerance:.0e} | {family.quirks} | {family.notes} |"
        )
    for name, refused in sorted(REFUSED.items()):
        measured = refused_results.get(name)
        gap = f"{measured['gap']:.1e}" if measured else "not measured"
        reload = f"{measured['reload_gap']:.1e}" if measured else "not measured"
        rows.append(
            f"| `{name}` | {refused.architecture} | {refused.shape.checkpoints} | refused | {gap} | {reload} | | | "
            f"| {LOGPROB_TOLERANCE:.0e} | {refused.shape.quirks} | {refused.reason}; use {refused.use_instead} |"
        )
    return "\n".join(rows)


def test_docs_table_lists_every_family_and_refusal() -> None:
    text = DOCS.read_text()
    table = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN) : text.index(TABLE_END)]
    named = re.findall(r"^\| `(\w+)` \| (\w+) \|", table, flags=re.M)
    expected = [(n, FAMILIES[n].architecture) for n in family_names()]
    expected += [(n, r.architecture) for n, r in sorted(REFUSED.items())]
    assert named == expected, f"docs/models.md's table is stale: rerun with {TABLE_ENV}=docs/models.md"


@pytest.fixture(scope="module", autouse=True)
def _write_family_table() -> Any:
    """With $PRIMERL_FAMILY_TABLE set (a markdown file with the markers), the measured table replaces its old one,
    once every family was measured."""
    yield
    target = os.environ.get(TABLE_ENV)
    measured = (set(RESULTS), set(RUN_RESULTS), set(REFUSED_RESULTS))
    if not target or measured != (set(FAMILIES), set(RUN_FAMILIES), set(REFUSED)):
        return
    path = Path(target)
    text = path.read_text()
    head, rest = text.split(TABLE_BEGIN)
    _, tail = rest.split(TABLE_END)
    from support.numerics import cpu_description

    total_s = sum(r["seconds"] for r in [*RESULTS.values(), *REFUSED_RESULTS.values()]) + sum(RUN_RESULTS.values())
    stamp = (
        f"\n_Measured by `tests/test_model_families.py` on {cpu_description()} ({total_s:.0f} s for the "
        f"{len(RESULTS) + len(REFUSED_RESULTS) + len(RUN_RESULTS)} engine tests)._\n\n"
    )
    table = family_table(RESULTS, RUN_RESULTS, REFUSED_RESULTS)
    path.write_text(f"{head}{TABLE_BEGIN}{stamp}{table}\n{TABLE_END}{tail}")

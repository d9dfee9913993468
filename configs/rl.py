"""`RLConfig`: the config of a whole run (`primerl rl @ config.toml`), in prime-rl's shape.

Top-level shared values (`[model] name`, `max_steps`, `seq_len`, `output_dir`, `max_async_level`, `[wandb]`,
`[log]`, the broker's address and token) fill the role sections wherever the role left them unset; a value
set in a role section wins. `role_configs()` splits the run into the four fully resolved role configs.
Ports: `primerl rl` gives the broker free ports for the ones the config leaves unset (`with_free_broker_ports`;
the launcher reads the bound ones from the broker and tells the other roles, so `[broker] grpc_port = 0` is
allowed too), inference picks a free HTTP port by default (`inference.server.port = 0`; the orchestrator finds
it through the broker), and Prometheus ports are per role (`[broker.prometheus]`, `[trainer.prometheus]`,
`[orchestrator.prometheus]`; inference serves its metrics on its API port) and default to 0, a free port each.
So two runs on one machine never collide unless their configs fix ports; fixed ports that clash within a run
are reported (`port_clashes`). `--dry-run --write` shows the ports as configured (the standalone defaults
50051-50053 for unset broker ports). A `[teacher]` table (or `teacher_gpu_ids`) adds a fifth role, the frozen
teacher server of online distillation (`primerl.configs.rl_teacher`: what is filled in, and the checks).
Files in the flat lab shape and the legacy vf-rl shape are translated first (`primerl.configs.rl_shapes`).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Annotated, Any

import pydantic
from pydantic import Field, model_validator

from primerl.configs.broker import BrokerConfig
from primerl.configs.dotted_keys import dotted_get as _get
from primerl.configs.dotted_keys import dotted_has as _has
from primerl.configs.dotted_keys import dotted_set_default as _set_default
from primerl.configs.inference import InferenceConfig, vllm_max_lora_rank_for
from primerl.configs.lora_support import moe_lora_problem
from primerl.configs.orchestrator import OrchestratorConfig
from primerl.configs.rl_shapes import to_canonical
from primerl.configs.rl_teacher import fill_teacher, has_teacher, teacher_problems, teacher_warnings
from primerl.configs.trainer import LoRAConfig, TrainerConfig
from primerl.runtime.config_base import BaseConfig, ConfigWarning, nearest_multiples
from primerl.runtime.config_common import DEFAULT_BROKER_GRPC_PORT, DEFAULT_BROKER_HOST, LogConfig, WandbConfig
from primerl.runtime.cpu_budget import CPU_SHARING_DEFAULT, CpuSharing

ROLES = ("broker", "trainer", "orchestrator", "inference")
BROKER_PORTS = ("grpc_port", "rollout_port", "weight_port")

# Where the shared model name goes in each role.
MODEL_NAME_PATHS = ("trainer.model.name", "trainer.tokenizer.name", "orchestrator.model.name", "inference.model.name")


class SharedModelConfig(BaseConfig):
    """The model of the run, shared by all roles."""

    name: str | None = Field(
        None, min_length=1, description="Hugging Face model id or local path; fills every role's model name."
    )


def _fill_table(data: dict[str, Any], dotted: str, shared: Any) -> None:
    """Fill the keys of the shared table that the role's table does not set."""
    if not isinstance(shared, dict):
        return
    for key, value in shared.items():
        _set_default(data, f"{dotted}.{key}", value)


def _section_dict(section: Any) -> Any:
    if isinstance(section, pydantic.BaseModel):
        return section.model_dump(exclude_unset=True)
    return copy.deepcopy(section) if isinstance(section, dict) else section


class RLConfig(BaseConfig):
    """A whole run: broker, trainer, orchestrator and inference on one machine (or one config for all)."""

    model: SharedModelConfig = Field(default_factory=SharedModelConfig, description="The model of the run.")
    max_steps: int | None = Field(None, ge=1, description="Training steps of the run (unset: no limit).")
    seq_len: int | None = Field(
        None, ge=1, description="Max tokens of a sample; fills trainer, orchestrator and inference.max_model_len."
    )
    inference_gpu_ids: list[int] = Field(
        default_factory=lambda: [0], min_length=1, description="GPUs of the inference server."
    )
    trainer_gpu_ids: list[int] = Field(
        default_factory=lambda: [1], min_length=1, description="GPUs of the trainer (one rank per GPU)."
    )
    teacher_gpu_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="GPUs of the teacher server (online distillation). Setting it starts a teacher even without "
        "a [teacher] table (prime-rl's way: it then serves the run's model). Unset with [teacher]: the GPUs after "
        "inference_gpu_ids and trainer_gpu_ids, as many as teacher.parallel tp x dp.",
    )
    wandb: WandbConfig | None = Field(None, description="Weights & Biases, shared by trainer and orchestrator.")
    output_dir: Path = Field(Path("outputs"), description="Directory of the run: weights, checkpoints, logs.")
    max_async_level: int | None = Field(
        None, ge=0, description="Max policy versions a sample may lag the trainer (fills the orchestrator's)."
    )
    cpu_sharing: CpuSharing = Field(
        CPU_SHARING_DEFAULT,
        description='How trainer and vLLM share the cores of a CPU-only machine: `"shared"`, each runs one thread '
        'per core and the one with work uses every core while the other waits (no idle core); `"split"`, '
        "each is held to half of the cores (the earlier default). Fills the unset `[<role>.threads]`; ignored "
        "with GPUs (`primerl.runtime.cpu_budget`).",
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Logging, shared by all roles.")
    broker: BrokerConfig = Field(description="The broker.")
    trainer: TrainerConfig = Field(description="The trainer.")
    orchestrator: OrchestratorConfig = Field(description="The orchestrator.")
    inference: InferenceConfig = Field(description="The inference server.")
    teacher: InferenceConfig | None = Field(
        None,
        description="The teacher server of online distillation (prime-rl's `[teacher_inference]` is an alias): "
        '`primerl rl` starts it as its own `primerl-infer` with `role = "teacher"` (a frozen model that never '
        "receives weight updates, on its own HTTP port) and points `[orchestrator.teacher]` at it. "
        "`[teacher.model] name` is the teacher's model; unset, the run's model (self-distillation: the student is "
        "pulled toward a frozen copy of its starting weights). Engine settings that [teacher] leaves unset "
        "(dtype, enforce_eager, max_model_len, kv_cache_memory_bytes, gpu_memory_utilization, server host) are "
        "inference's. Absent (and no teacher_gpu_ids): no teacher server.",
    )

    @classmethod
    def normalize_raw(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        """Translate the flat lab and legacy vf-rl shapes into this (prime-rl) shape."""
        return to_canonical(data, source)

    # ------------------------------------------------------------------------------------------------------
    # Shared values flow into the roles (on the raw data, so that explicit role values can be told apart).

    @model_validator(mode="before")
    @classmethod
    def _fill_roles(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {key: _section_dict(value) for key, value in data.items()}
        if isinstance(data.get("model"), str):
            data["model"] = {"name": data["model"]}
        for role in ROLES:
            data.setdefault(role, {})
        # A role section that is not a table is reported by validation; the others are still filled.
        not_tables = {role: data[role] for role in ROLES if not isinstance(data[role], dict)}
        data.update({role: {} for role in not_tables})
        # A shared value that is itself invalid is reported once, at the top level, and not copied.
        shared = {k: v for k, v in data.items() if k not in ROLES and v is not None and _is_valid_shared(k, v)}
        _fill_model_name(data)
        for role in ("trainer", "orchestrator"):
            for key in ("max_steps", "output_dir"):
                if key in shared:
                    _set_default(data, f"{role}.{key}", shared[key])
            _fill_table(data, f"{role}.wandb", shared.get("wandb"))
        if "max_steps" in shared:
            _set_default(data, "broker.max_steps", shared["max_steps"])
        trainer_gpu_ids = data.get("trainer_gpu_ids")
        if isinstance(trainer_gpu_ids, list) and trainer_gpu_ids:
            _set_default(data, "orchestrator.num_train_ranks", len(trainer_gpu_ids))
        if "max_async_level" in shared:
            _set_default(data, "orchestrator.max_async_level", shared["max_async_level"])
        _fill_seq_len(data, shared.get("seq_len"))
        _set_default(data, "broker.spool_dir", str(Path(shared.get("output_dir", "outputs")) / "broker" / "spool"))
        for role in ROLES:
            _fill_table(data, f"{role}.log", shared.get("log"))
        if has_teacher(data):
            _fill_table(data, "teacher.log", shared.get("log"))
        _fill_broker_client(data)
        _fill_inference(data)
        fill_teacher(data)
        data.update(not_tables)
        return data

    # ------------------------------------------------------------------------------------------------------
    # Checks across roles.

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        problems = [
            *self._gpu_problems(),
            *self._length_problems(),
            *self._lora_problems(),
            *self._batch_problems(),
            *self._connection_problems(),
            *self._trainer_rank_problems(),
            *self._wire_security_problems(),
            *teacher_problems(self),
        ]
        if problems:
            raise ValueError("\n".join(problems))
        for note in teacher_warnings(self):
            warnings.warn(note, ConfigWarning, stacklevel=2)
        for clash in self.port_clashes():
            warnings.warn(
                f"{clash}: fine on separate machines, but `primerl rl` runs every role on this one and "
                "refuses to start",
                ConfigWarning,
                stacklevel=2,
            )
        if self.trainer.max_steps != self.orchestrator.max_steps:
            warnings.warn(
                f"trainer.max_steps ({self.trainer.max_steps}) differs from orchestrator.max_steps "
                f"({self.orchestrator.max_steps}); the run ends at the smaller one",
                ConfigWarning,
                stacklevel=2,
            )
        return self

    def _gpu_problems(self) -> list[str]:
        problems = []
        for name in ("inference_gpu_ids", "trainer_gpu_ids"):
            ids = getattr(self, name)
            if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                problems.append(f"{name} = {ids} must list distinct GPU indices >= 0")
        shared = sorted(set(self.inference_gpu_ids) & set(self.trainer_gpu_ids))
        if shared:
            problems.append(
                f"GPUs {shared} are in both inference_gpu_ids {self.inference_gpu_ids} and trainer_gpu_ids "
                f"{self.trainer_gpu_ids}; give each GPU to one role (e.g. inference_gpu_ids = [0], "
                "trainer_gpu_ids = [1])"
            )
        parallel = self.inference.parallel
        if parallel.tp * parallel.dp != len(self.inference_gpu_ids):
            problems.append(
                f"inference.parallel.tp x dp = {parallel.tp} x {parallel.dp} = {parallel.tp * parallel.dp} GPUs, "
                f"but inference_gpu_ids has {len(self.inference_gpu_ids)}; make them match"
            )
        return problems

    def _length_problems(self) -> list[str]:
        problems = []
        sample_len = self.orchestrator.seq_len
        max_model_len = self.inference.model.max_model_len
        if max_model_len is not None and max_model_len < sample_len:
            problems.append(
                f"inference.model.max_model_len ({max_model_len}) is smaller than seq_len ({sample_len}): vLLM "
                f"would stop rollouts before they reach seq_len. Set inference.model.max_model_len >= {sample_len} "
                "or lower seq_len"
            )
        if self.trainer.seq_len < sample_len:
            problems.append(
                f"trainer.seq_len ({self.trainer.seq_len}) is smaller than orchestrator.seq_len ({sample_len}): "
                "the longest samples would not fit a training sequence. Set them equal (top-level seq_len)"
            )
        return problems

    def _lora_problems(self) -> list[str]:
        lora = self.trainer.model.lora
        problems = []
        if self.inference.enable_lora:
            moe_problem = moe_lora_problem(self.inference.model.name)
            if moe_problem:
                problems.append(moe_problem)
        if lora is not None and self.trainer.weight_broadcast.type == "lora":
            if not self.inference.enable_lora:
                problems.append(
                    "the trainer trains LoRA and publishes adapters, but inference.enable_lora = false; set it true "
                    '(or trainer.weight_broadcast.type = "full" to publish merged weights)'
                )
            max_rank = self.inference.max_lora_rank
            if max_rank is not None and max_rank < lora.rank:
                problems.append(
                    f"inference.max_lora_rank ({max_rank}) is smaller than trainer.model.lora.rank ({lora.rank}): "
                    f"vLLM could not load the adapter. Set inference.max_lora_rank = "
                    f"{vllm_max_lora_rank_for(lora.rank)} (or remove it to have it set from the rank)"
                )
        return problems

    def _batch_problems(self) -> list[str]:
        micro_batch_size = self.trainer.micro_batch_size
        if micro_batch_size is None:
            return []
        num_ranks = len(self.trainer_gpu_ids)
        per_round = micro_batch_size * num_ranks
        batch_size = self.orchestrator.batch_size
        if batch_size % per_round:
            valid = " or ".join(str(m) for m in nearest_multiples(batch_size, per_round))
            return [
                f"orchestrator.batch_size ({batch_size}) must be divisible by trainer.micro_batch_size x trainer "
                f"ranks = {micro_batch_size} x {num_ranks} = {per_round}: use batch_size = {valid}"
            ]
        accumulation = self.trainer.gradient_accumulation_steps
        if accumulation is not None and accumulation * per_round != batch_size:
            return [
                f"trainer.gradient_accumulation_steps ({accumulation}) x micro_batch_size ({micro_batch_size}) x "
                f"ranks ({num_ranks}) must equal orchestrator.batch_size ({batch_size}): set "
                f"gradient_accumulation_steps = {batch_size // per_round} or remove it"
            ]
        return []

    def _trainer_rank_problems(self) -> list[str]:
        num_ranks = len(self.trainer_gpu_ids)
        if num_ranks > 1 and self.trainer.model.parallel == "fsdp2":
            return [
                f'trainer.model.parallel = "fsdp2" with {num_ranks} trainer ranks (trainer_gpu_ids = '
                f"{self.trainer_gpu_ids}): publishing, checkpointing and exporting sharded weights are not built "
                'yet; set [trainer.model] parallel = "ddp", or leave it unset (ddp with several ranks)'
            ]
        return []

    def _connection_problems(self) -> list[str]:
        peers = len(self.trainer_gpu_ids) + 1  # a consumer per trainer rank, the orchestrator's producer
        limit = self.broker.max_rollout_connections
        if peers <= limit:
            return []
        return [
            f"broker.max_rollout_connections ({limit}) is less than the rollout peers of this run: "
            f"{peers - 1} trainer ranks + 1 orchestrator = {peers}; set broker.max_rollout_connections = {peers} "
            "or more"
        ]

    def _wire_security_problems(self) -> list[str]:
        """Every role must match the broker's wire security (a mismatch would only show as timeouts)."""
        broker, problems = self.broker, []
        for role in ("trainer", "orchestrator", "inference", "teacher"):
            if getattr(self, role) is None:
                continue
            client = getattr(self, role).broker
            if (broker.curve_secret_key_path is None) != (client.curve_secret_key_path is None):
                problems.append(
                    f"broker.curve_secret_key_path and {role}.broker.curve_secret_key_path: CURVE must be on for the "
                    f"broker and every role, or off for all (`primerl certs` prints the [{role}.broker] keys)"
                )
            if broker.tls_client_ca_path is not None and client.tls_cert_path is None:
                problems.append(
                    f"broker.tls_client_ca_path requires client certificates: set {role}.broker."
                    "tls_cert_path and tls_key_path (`primerl certs` prints them)"
                )
            if broker.tls_cert_path is None and client.tls_ca_path is not None:
                problems.append(f"{role}.broker.tls_ca_path is set but the broker has no TLS (broker.tls_cert_path)")
        return problems

    def with_free_broker_ports(self) -> RLConfig:
        """This run as `primerl rl` starts it: the broker ports that the config leaves unset are 0, so the broker
        binds free ones and two runs on one machine never collide; the launcher tells the other roles the ports
        bound (they dial a placeholder until then). Ports set in the config, even to the standalone defaults
        50051-50053, are kept."""
        free = {name: 0 for name in BROKER_PORTS if name not in self.broker.model_fields_set}
        if not free:
            return self
        return self.model_copy(update={"broker": self.broker.model_copy(update=free)})

    def port_clashes(self) -> list[str]:
        """Fixed (non-zero) ports that two roles would bind on one machine, one message per clash (broker ports
        left unset count as free: ``with_free_broker_ports``)."""
        ports = {
            f"broker.{name}": getattr(self.broker, name) if name in self.broker.model_fields_set else 0
            for name in BROKER_PORTS
        }
        ports["inference.server.port"] = self.inference.server.port
        if self.teacher is not None:
            ports["teacher.server.port"] = self.teacher.server.port
        for role in ("broker", "trainer", "orchestrator"):
            prometheus = getattr(self, role).prometheus
            if prometheus.enabled:
                ports[f"{role}.prometheus.port"] = prometheus.port
        by_port: dict[int, list[str]] = {}
        for key, port in ports.items():
            if port != 0:
                by_port.setdefault(port, []).append(key)
        return [
            f"{' and '.join(keys)} are {'both' if len(keys) == 2 else 'all'} {port}; give each its own port, "
            "or 0 for a free one"
            for port, keys in by_port.items()
            if len(keys) > 1
        ]

    # ------------------------------------------------------------------------------------------------------

    def role_configs(self) -> dict[str, BaseConfig]:
        """The role configs of the run, fully resolved (each one independent of this object): the four roles,
        and `teacher` when the run has a teacher server."""
        roles = {role: getattr(self, role).model_copy(deep=True) for role in ROLES}
        if self.teacher is not None:
            roles["teacher"] = self.teacher.model_copy(deep=True)
        return roles


def _fill_model_name(data: dict[str, Any]) -> None:
    shared = _get(data, "model.name")
    explicit = {path: _get(data, path) for path in MODEL_NAME_PATHS if _get(data, path) is not None}
    name = (
        shared
        if shared is not None
        else next(
            (
                explicit[p]
                for p in ("trainer.model.name", "inference.model.name", "orchestrator.model.name")
                if p in explicit
            ),
            None,
        )
    )
    if name is None:
        raise ValueError('no model: set it once for all roles with `[model] name = "..."` (or `model = "..."`)')
    for path in MODEL_NAME_PATHS:
        _set_default(data, path, name)
    for path, value in explicit.items():
        if value != name:
            note = " (a different tokenizer is allowed but unusual)" if "tokenizer" in path else ""
            warnings.warn(
                f"{path} = {value!r} differs from the run's model {name!r}{note}", ConfigWarning, stacklevel=4
            )


def _is_valid_shared(name: str, value: Any) -> bool:
    field = RLConfig.model_fields.get(name)
    if field is None:
        return False
    try:
        annotation = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
        pydantic.TypeAdapter(annotation).validate_python(value)
    except pydantic.ValidationError:
        return False
    return True


def _fill_seq_len(data: dict[str, Any], seq_len: Any) -> None:
    if seq_len is None:
        candidates = (_get(data, "orchestrator.seq_len"), _get(data, "trainer.seq_len"))
        seq_len = next((v for v in candidates if _is_valid_shared("seq_len", v) and v is not None), None)
    if seq_len is None:
        seq_len = OrchestratorConfig.model_fields["seq_len"].default
    for path in ("trainer.seq_len", "orchestrator.seq_len", "inference.model.max_model_len"):
        _set_default(data, path, seq_len)


def _fill_broker_client(data: dict[str, Any]) -> None:
    broker = data["broker"]
    host = broker.get("host", DEFAULT_BROKER_HOST)
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    port = broker.get("grpc_port", DEFAULT_BROKER_GRPC_PORT)
    if port == 0:  # a free port: `primerl rl` tells the roles the one bound; a placeholder until then
        port = DEFAULT_BROKER_GRPC_PORT
    for role in ("trainer", "orchestrator", "inference", *(("teacher",) if has_teacher(data) else ())):
        if not isinstance(data.get(role, {}), dict):
            continue  # validation reports it
        _set_default(data, f"{role}.broker.address", f"{host}:{port}")
        if broker.get("run_token") is not None:
            _set_default(data, f"{role}.broker.run_token", broker["run_token"])
        if broker.get("tls_cert_path") is not None:
            _set_default(data, f"{role}.broker.tls_ca_path", broker["tls_cert_path"])
        if broker.get("outage_s") is not None:
            _set_default(data, f"{role}.broker.outage_s", broker["outage_s"])


def _fill_inference(data: dict[str, Any]) -> None:
    inference_dtype = _get(data, "inference.model.dtype")
    if isinstance(inference_dtype, str) and inference_dtype != "auto":  # publish what the workers serve
        _set_default(data, "trainer.weight_broadcast.dtype", inference_dtype)
    gpu_ids = data.get("inference_gpu_ids", [0])
    tp = _get(data, "inference.parallel.tp") or 1
    if isinstance(gpu_ids, list) and isinstance(tp, int) and tp > 0 and len(gpu_ids) % tp == 0 and gpu_ids:
        _set_default(data, "inference.parallel.dp", len(gpu_ids) // tp)
    model = data["trainer"].get("model")
    lora = None
    if isinstance(model, dict):
        lora = model.get("lora", _get(model, "experimental.lora"))
    if isinstance(lora, dict) and _get(data, "trainer.weight_broadcast.type") in (None, "lora"):
        _set_default(data, "inference.enable_lora", True)
        rank = lora.get("rank", LoRAConfig.model_fields["rank"].default)
        if isinstance(rank, int) and not _has(data, "inference.max_lora_rank"):
            _set_default(data, "inference.max_lora_rank", vllm_max_lora_rank_for(rank))

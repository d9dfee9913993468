from primerl.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_ALIVE: _ClassVar[WorkerState]
    WORKER_STATE_LOST: _ClassVar[WorkerState]
    WORKER_STATE_LEFT: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_ALIVE: WorkerState
WORKER_STATE_LOST: WorkerState
WORKER_STATE_LEFT: WorkerState

class RegisterRequest(_message.Message):
    __slots__ = ("role", "name", "address", "capabilities", "rank", "world_size", "pid", "hostname", "policy_lineage", "instance_id")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    name: str
    address: str
    capabilities: _containers.ScalarMap[str, str]
    rank: int
    world_size: int
    pid: int
    hostname: str
    policy_lineage: int
    instance_id: str
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ..., policy_lineage: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "run_id", "heartbeat_interval_ms", "liveness", "rollout_endpoint", "weight_endpoint", "latest_policy_version", "limits", "policy_lineage")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    POLICY_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    run_id: str
    heartbeat_interval_ms: int
    liveness: int
    rollout_endpoint: str
    weight_endpoint: str
    latest_policy_version: int
    limits: DataPlaneLimits
    policy_lineage: int
    def __init__(self, worker_id: _Optional[str] = ..., run_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., liveness: _Optional[int] = ..., rollout_endpoint: _Optional[str] = ..., weight_endpoint: _Optional[str] = ..., latest_policy_version: _Optional[int] = ..., limits: _Optional[_Union[DataPlaneLimits, _Mapping]] = ..., policy_lineage: _Optional[int] = ...) -> None: ...

class DataPlaneLimits(_message.Message):
    __slots__ = ("max_frame_bytes", "max_message_bytes", "max_envelope_bytes", "max_payload_frames", "max_transfer_bytes", "weight_chunk_bytes")
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENVELOPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYLOAD_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_frame_bytes: int
    max_message_bytes: int
    max_envelope_bytes: int
    max_payload_frames: int
    max_transfer_bytes: int
    weight_chunk_bytes: int
    def __init__(self, max_frame_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_envelope_bytes: _Optional[int] = ..., max_payload_frames: _Optional[int] = ..., max_transfer_bytes: _Optional[int] = ..., weight_chunk_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "trainer_step", "policy_version", "orchestrator_step", "num_inflight", "recent_errors", "not_serving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    trainer_step: int
    policy_version: int
    orchestrator_step: int
    num_inflight: int
    recent_errors: _containers.RepeatedScalarFieldContainer[str]
    not_serving: str
    def __init__(self, worker_id: _Optional[str] = ..., trainer_step: _Optional[int] = ..., policy_version: _Optional[int] = ..., orchestrator_step: _Optional[int] = ..., num_inflight: _Optional[int] = ..., recent_errors: _Optional[_Iterable[str]] = ..., not_serving: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("latest_policy_version", "last_committed_step", "shutdown_requested", "policy_lineage", "lineage_base_version", "heartbeat_interval_ms")
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    latest_policy_version: int
    last_committed_step: int
    shutdown_requested: bool
    policy_lineage: int
    lineage_base_version: int
    heartbeat_interval_ms: int
    def __init__(self, latest_policy_version: _Optional[int] = ..., last_committed_step: _Optional[int] = ..., shutdown_requested: _Optional[bool] = ..., policy_lineage: _Optional[int] = ..., lineage_base_version: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRunStatusRequest(_message.Message):
    __slots__ = ("min_interval_ms",)
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    min_interval_ms: int
    def __init__(self, min_interval_ms: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role", "include_gone")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_GONE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    include_gone: bool
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., include_gone: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "name", "address", "capabilities", "state", "rank", "world_size", "registered_unix_ms", "last_heartbeat_unix_ms", "trainer_step", "policy_version", "orchestrator_step", "num_inflight", "hostname", "pid")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.Role
    name: str
    address: str
    capabilities: _containers.ScalarMap[str, str]
    state: WorkerState
    rank: int
    world_size: int
    registered_unix_ms: int
    last_heartbeat_unix_ms: int
    trainer_step: int
    policy_version: int
    orchestrator_step: int
    num_inflight: int
    hostname: str
    pid: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., name: _Optional[str] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., registered_unix_ms: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., trainer_step: _Optional[int] = ..., policy_version: _Optional[int] = ..., orchestrator_step: _Optional[int] = ..., num_inflight: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ReportMetricsRequest(_message.Message):
    __slots__ = ("worker_id", "step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportMetricsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("worker_id", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class CommitStepResponse(_message.Message):
    __slots__ = ("last_committed_step", "num_batches_released")
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    last_committed_step: int
    num_batches_released: int
    def __init__(self, last_committed_step: _Optional[int] = ..., num_batches_released: _Optional[int] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("name", "num_items", "num_bytes", "capacity_items", "capacity_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_ITEMS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_items: int
    num_bytes: int
    capacity_items: int
    capacity_bytes: int
    def __init__(self, name: _Optional[str] = ..., num_items: _Optional[int] = ..., num_bytes: _Optional[int] = ..., capacity_items: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "broker_started_unix_ms", "updated_unix_ms", "trainer_step", "last_committed_step", "latest_policy_version", "orchestrator_step", "workers", "queues", "rollout_batches_per_s", "rollout_bytes_per_s", "weight_bytes_per_s", "last_metrics", "last_metrics_step", "recent_errors", "max_steps", "policy_lineage", "lineage_base_version", "num_rollbacks")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_BATCHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_STEP_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    broker_started_unix_ms: int
    updated_unix_ms: int
    trainer_step: int
    last_committed_step: int
    latest_policy_version: int
    orchestrator_step: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    rollout_batches_per_s: float
    rollout_bytes_per_s: float
    weight_bytes_per_s: float
    last_metrics: _containers.ScalarMap[str, float]
    last_metrics_step: int
    recent_errors: _containers.RepeatedScalarFieldContainer[str]
    max_steps: int
    policy_lineage: int
    lineage_base_version: int
    num_rollbacks: int
    def __init__(self, run_id: _Optional[str] = ..., broker_started_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., trainer_step: _Optional[int] = ..., last_committed_step: _Optional[int] = ..., latest_policy_version: _Optional[int] = ..., orchestrator_step: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., rollout_batches_per_s: _Optional[float] = ..., rollout_bytes_per_s: _Optional[float] = ..., weight_bytes_per_s: _Optional[float] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., last_metrics_step: _Optional[int] = ..., recent_errors: _Optional[_Iterable[str]] = ..., max_steps: _Optional[int] = ..., policy_lineage: _Optional[int] = ..., lineage_base_version: _Optional[int] = ..., num_rollbacks: _Optional[int] = ...) -> None: ...

class ReportRolloutsRequest(_message.Message):
    __slots__ = ("worker_id", "step", "records")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    step: int
    records: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., step: _Optional[int] = ..., records: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportRolloutsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunHistoryRequest(_message.Message):
    __slots__ = ("metrics_since", "events_since", "rollouts_since")
    METRICS_SINCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SINCE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_SINCE_FIELD_NUMBER: _ClassVar[int]
    metrics_since: int
    events_since: int
    rollouts_since: int
    def __init__(self, metrics_since: _Optional[int] = ..., events_since: _Optional[int] = ..., rollouts_since: _Optional[int] = ...) -> None: ...

class MetricRow(_message.Message):
    __slots__ = ("step", "role", "unix_ms", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    role: _common_pb2.Role
    unix_ms: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., unix_ms: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("unix_ms", "step", "kind", "source", "message")
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    step: int
    kind: str
    source: str
    message: str
    def __init__(self, unix_ms: _Optional[int] = ..., step: _Optional[int] = ..., kind: _Optional[str] = ..., source: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RunHistory(_message.Message):
    __slots__ = ("rows", "events", "rollouts", "metrics_next", "events_next", "rollouts_next", "num_bytes", "max_bytes", "truncated")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_NEXT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_NEXT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_NEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[MetricRow]
    events: _containers.RepeatedCompositeFieldContainer[RunEvent]
    rollouts: _containers.RepeatedScalarFieldContainer[str]
    metrics_next: int
    events_next: int
    rollouts_next: int
    num_bytes: int
    max_bytes: int
    truncated: bool
    def __init__(self, rows: _Optional[_Iterable[_Union[MetricRow, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[RunEvent, _Mapping]]] = ..., rollouts: _Optional[_Iterable[str]] = ..., metrics_next: _Optional[int] = ..., events_next: _Optional[int] = ..., rollouts_next: _Optional[int] = ..., num_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

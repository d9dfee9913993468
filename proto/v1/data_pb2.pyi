from primerl.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MessageType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MESSAGE_TYPE_UNSPECIFIED: _ClassVar[MessageType]
    ROLLOUT_BATCH: _ClassVar[MessageType]
    ROLLOUT_ACK: _ClassVar[MessageType]
    ROLLOUT_REQUEST: _ClassVar[MessageType]
    WEIGHT_UPDATE: _ClassVar[MessageType]
    WEIGHT_ACK: _ClassVar[MessageType]
    ERROR: _ClassVar[MessageType]
    HELLO: _ClassVar[MessageType]
    ROLLOUT_STEP_DONE: _ClassVar[MessageType]

class ChecksumKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_KIND_CRC32: _ClassVar[ChecksumKind]
    CHECKSUM_KIND_XXH3_64: _ClassVar[ChecksumKind]

class WeightUpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_UPDATE_KIND_UNSPECIFIED: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_FULL: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_LORA: _ClassVar[WeightUpdateKind]
    WEIGHT_UPDATE_KIND_DELTA: _ClassVar[WeightUpdateKind]

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_XOR_ZLIB: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_SPARSE: _ClassVar[DeltaEncoding]
MESSAGE_TYPE_UNSPECIFIED: MessageType
ROLLOUT_BATCH: MessageType
ROLLOUT_ACK: MessageType
ROLLOUT_REQUEST: MessageType
WEIGHT_UPDATE: MessageType
WEIGHT_ACK: MessageType
ERROR: MessageType
HELLO: MessageType
ROLLOUT_STEP_DONE: MessageType
CHECKSUM_KIND_CRC32: ChecksumKind
CHECKSUM_KIND_XXH3_64: ChecksumKind
WEIGHT_UPDATE_KIND_UNSPECIFIED: WeightUpdateKind
WEIGHT_UPDATE_KIND_FULL: WeightUpdateKind
WEIGHT_UPDATE_KIND_LORA: WeightUpdateKind
WEIGHT_UPDATE_KIND_DELTA: WeightUpdateKind
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
DELTA_ENCODING_XOR_ZLIB: DeltaEncoding
DELTA_ENCODING_SPARSE: DeltaEncoding

class Chunk(_message.Message):
    __slots__ = ("transfer_id", "index", "count", "total_bytes", "payload_digest")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    index: int
    count: int
    total_bytes: int
    payload_digest: str
    def __init__(self, transfer_id: _Optional[str] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., payload_digest: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("message_id", "sent_unix_ms", "header", "chunk", "num_payload_frames", "payload_frame_bytes", "checksum", "auth_token", "in_reply_to", "sender", "checksum_kind", "checksum64", "relay_hops")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NUM_PAYLOAD_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IN_REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM64_FIELD_NUMBER: _ClassVar[int]
    RELAY_HOPS_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    sent_unix_ms: int
    header: bytes
    chunk: Chunk
    num_payload_frames: int
    payload_frame_bytes: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    auth_token: str
    in_reply_to: str
    sender: str
    checksum_kind: ChecksumKind
    checksum64: int
    relay_hops: _containers.RepeatedCompositeFieldContainer[RelayHop]
    def __init__(self, message_id: _Optional[str] = ..., sent_unix_ms: _Optional[int] = ..., header: _Optional[bytes] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., num_payload_frames: _Optional[int] = ..., payload_frame_bytes: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., auth_token: _Optional[str] = ..., in_reply_to: _Optional[str] = ..., sender: _Optional[str] = ..., checksum_kind: _Optional[_Union[ChecksumKind, str]] = ..., checksum64: _Optional[int] = ..., relay_hops: _Optional[_Iterable[_Union[RelayHop, _Mapping]]] = ...) -> None: ...

class RelayHop(_message.Message):
    __slots__ = ("worker_id", "endpoint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "role", "rank", "policy_version", "lineage", "relay_endpoint", "host_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    RELAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.Role
    rank: int
    policy_version: int
    lineage: int
    relay_endpoint: str
    host_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., rank: _Optional[int] = ..., policy_version: _Optional[int] = ..., lineage: _Optional[int] = ..., relay_endpoint: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class RolloutBatchHeader(_message.Message):
    __slots__ = ("step", "rank", "micro_batch_index", "num_micro_batches", "num_samples", "num_tokens", "min_policy_version", "max_policy_version", "tensors", "batch_id", "num_loss_tokens_global")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LOSS_TOKENS_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    micro_batch_index: int
    num_micro_batches: int
    num_samples: int
    num_tokens: int
    min_policy_version: int
    max_policy_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    batch_id: str
    num_loss_tokens_global: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., micro_batch_index: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., num_samples: _Optional[int] = ..., num_tokens: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., batch_id: _Optional[str] = ..., num_loss_tokens_global: _Optional[int] = ...) -> None: ...

class RolloutAck(_message.Message):
    __slots__ = ("batch_id", "step", "durable", "error")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    step: int
    durable: bool
    error: _common_pb2.ErrorDetail
    def __init__(self, batch_id: _Optional[str] = ..., step: _Optional[int] = ..., durable: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("step", "rank", "credits")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    credits: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., credits: _Optional[int] = ...) -> None: ...

class RolloutStepDone(_message.Message):
    __slots__ = ("step", "rank", "num_micro_batches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    num_micro_batches: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., num_micro_batches: _Optional[int] = ...) -> None: ...

class WeightUpdateHeader(_message.Message):
    __slots__ = ("policy_version", "kind", "base_version", "digest", "tensors", "decoded_tensors", "delta_encoding", "adapter_config_json", "policy_name", "payload_bytes", "lineage", "lineage_base_version", "shared_segment")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DECODED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    DELTA_ENCODING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    kind: WeightUpdateKind
    base_version: int
    digest: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    decoded_tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    delta_encoding: DeltaEncoding
    adapter_config_json: str
    policy_name: str
    payload_bytes: int
    lineage: int
    lineage_base_version: int
    shared_segment: SharedSegment
    def __init__(self, policy_version: _Optional[int] = ..., kind: _Optional[_Union[WeightUpdateKind, str]] = ..., base_version: _Optional[int] = ..., digest: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., decoded_tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., delta_encoding: _Optional[_Union[DeltaEncoding, str]] = ..., adapter_config_json: _Optional[str] = ..., policy_name: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., lineage: _Optional[int] = ..., lineage_base_version: _Optional[int] = ..., shared_segment: _Optional[_Union[SharedSegment, _Mapping]] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("path", "host_id", "generation")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    path: str
    host_id: str
    generation: int
    def __init__(self, path: _Optional[str] = ..., host_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class WeightAck(_message.Message):
    __slots__ = ("policy_version", "worker_id", "applied", "error", "apply_ms", "full_required", "lineage")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLY_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    worker_id: str
    applied: bool
    error: _common_pb2.ErrorDetail
    apply_ms: int
    full_required: bool
    lineage: int
    def __init__(self, policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., applied: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., apply_ms: _Optional[int] = ..., full_required: _Optional[bool] = ..., lineage: _Optional[int] = ...) -> None: ...

class ErrorReply(_message.Message):
    __slots__ = ("error", "refused_type")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TYPE_FIELD_NUMBER: _ClassVar[int]
    error: _common_pb2.ErrorDetail
    refused_type: MessageType
    def __init__(self, error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., refused_type: _Optional[_Union[MessageType, str]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_BROKER: _ClassVar[Role]
    ROLE_TRAINER: _ClassVar[Role]
    ROLE_INFERENCE: _ClassVar[Role]
    ROLE_ORCHESTRATOR: _ClassVar[Role]
    ROLE_CLIENT: _ClassVar[Role]
    ROLE_TEACHER: _ClassVar[Role]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_TRUNCATED: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_PROTOCOL: _ClassVar[ErrorCode]
    ERROR_CODE_UNSUPPORTED_VERSION: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_MESSAGE_TYPE: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_CHECKSUM: _ClassVar[ErrorCode]
    ERROR_CODE_OVERSIZED: _ClassVar[ErrorCode]
    ERROR_CODE_MALFORMED_HEADER: _ClassVar[ErrorCode]
    ERROR_CODE_TENSOR_MISMATCH: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_CHUNK: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]
    ERROR_CODE_BAD_DIGEST: _ClassVar[ErrorCode]
    ERROR_CODE_OUT_OF_ORDER: _ClassVar[ErrorCode]
    ERROR_CODE_BACKPRESSURE: _ClassVar[ErrorCode]
    ERROR_CODE_UNKNOWN_WORKER: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
ROLE_UNSPECIFIED: Role
ROLE_BROKER: Role
ROLE_TRAINER: Role
ROLE_INFERENCE: Role
ROLE_ORCHESTRATOR: Role
ROLE_CLIENT: Role
ROLE_TEACHER: Role
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_TRUNCATED: ErrorCode
ERROR_CODE_UNKNOWN_PROTOCOL: ErrorCode
ERROR_CODE_UNSUPPORTED_VERSION: ErrorCode
ERROR_CODE_UNKNOWN_MESSAGE_TYPE: ErrorCode
ERROR_CODE_BAD_CHECKSUM: ErrorCode
ERROR_CODE_OVERSIZED: ErrorCode
ERROR_CODE_MALFORMED_HEADER: ErrorCode
ERROR_CODE_TENSOR_MISMATCH: ErrorCode
ERROR_CODE_BAD_CHUNK: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode
ERROR_CODE_BAD_DIGEST: ErrorCode
ERROR_CODE_OUT_OF_ORDER: ErrorCode
ERROR_CODE_BACKPRESSURE: ErrorCode
ERROR_CODE_UNKNOWN_WORKER: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode

class ErrorDetail(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

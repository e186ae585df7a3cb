from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LocalLocateRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class LocalLocateResponse(_message.Message):
    __slots__ = ("savers", "generation")
    SAVERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    savers: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    def __init__(self, savers: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ...) -> None: ...

class FetchStepRequest(_message.Message):
    __slots__ = ("owner_rank", "step", "manifest_only", "replace_local", "timeout_seconds")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    manifest_only: bool
    replace_local: bool
    timeout_seconds: float
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., manifest_only: _Optional[bool] = ..., replace_local: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FetchStepResponse(_message.Message):
    __slots__ = ("step_dir", "manifest_json")
    STEP_DIR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    step_dir: str
    manifest_json: bytes
    def __init__(self, step_dir: _Optional[str] = ..., manifest_json: _Optional[bytes] = ...) -> None: ...

class StepFile(_message.Message):
    __slots__ = ("name", "size", "crc32c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    crc32c: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class FetchFilesRequest(_message.Message):
    __slots__ = ("owner_rank", "step", "files", "dest_dir", "timeout_seconds")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    DEST_DIR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    files: _containers.RepeatedCompositeFieldContainer[StepFile]
    dest_dir: str
    timeout_seconds: float
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., files: _Optional[_Iterable[_Union[StepFile, _Mapping]]] = ..., dest_dir: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FetchFilesResponse(_message.Message):
    __slots__ = ("source", "bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    source: str
    bytes: int
    def __init__(self, source: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetPreemptionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPreemptionResponse(_message.Message):
    __slots__ = ("notice_step", "noticed")
    NOTICE_STEP_FIELD_NUMBER: _ClassVar[int]
    NOTICED_FIELD_NUMBER: _ClassVar[int]
    notice_step: int
    noticed: bool
    def __init__(self, notice_step: _Optional[int] = ..., noticed: _Optional[bool] = ...) -> None: ...

class BackupNowRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackupNowResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepCommittedRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class StepCommittedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLocalStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLocalStatusResponse(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

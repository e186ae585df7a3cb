from mtc_rpc import tier_pb2 as _tier_pb2
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
    __slots__ = ("owner_rank", "step", "manifest_only", "replace_local", "timeout_seconds", "min_generation")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    manifest_only: bool
    replace_local: bool
    timeout_seconds: float
    min_generation: int
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., manifest_only: _Optional[bool] = ..., replace_local: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ..., min_generation: _Optional[int] = ...) -> None: ...

class FetchStepResponse(_message.Message):
    __slots__ = ("step_dir", "manifest_json")
    STEP_DIR_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    step_dir: str
    manifest_json: bytes
    def __init__(self, step_dir: _Optional[str] = ..., manifest_json: _Optional[bytes] = ...) -> None: ...

class FileLanded(_message.Message):
    __slots__ = ("index", "bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    bytes: int
    def __init__(self, index: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StepLanding(_message.Message):
    __slots__ = ("manifest_json", "tmp_dir", "step_dir", "part_suffix", "landed", "committed")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    TMP_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_DIR_FIELD_NUMBER: _ClassVar[int]
    PART_SUFFIX_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    manifest_json: bytes
    tmp_dir: str
    step_dir: str
    part_suffix: str
    landed: _containers.RepeatedCompositeFieldContainer[FileLanded]
    committed: bool
    def __init__(self, manifest_json: _Optional[bytes] = ..., tmp_dir: _Optional[str] = ..., step_dir: _Optional[str] = ..., part_suffix: _Optional[str] = ..., landed: _Optional[_Iterable[_Union[FileLanded, _Mapping]]] = ..., committed: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("owner_rank", "step", "files", "dest_dir", "timeout_seconds", "pieces")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    DEST_DIR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    files: _containers.RepeatedCompositeFieldContainer[StepFile]
    dest_dir: str
    timeout_seconds: float
    pieces: _containers.RepeatedCompositeFieldContainer[FilePiece]
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., files: _Optional[_Iterable[_Union[StepFile, _Mapping]]] = ..., dest_dir: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., pieces: _Optional[_Iterable[_Union[FilePiece, _Mapping]]] = ...) -> None: ...

class FilePiece(_message.Message):
    __slots__ = ("name", "offset", "length", "crc32c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    crc32c: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("notice_step", "noticed", "this_host")
    NOTICE_STEP_FIELD_NUMBER: _ClassVar[int]
    NOTICED_FIELD_NUMBER: _ClassVar[int]
    THIS_HOST_FIELD_NUMBER: _ClassVar[int]
    notice_step: int
    noticed: bool
    this_host: bool
    def __init__(self, notice_step: _Optional[int] = ..., noticed: _Optional[bool] = ..., this_host: _Optional[bool] = ...) -> None: ...

class PreemptRequest(_message.Message):
    __slots__ = ("save_window_seconds", "flush_seconds")
    SAVE_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    save_window_seconds: float
    flush_seconds: float
    def __init__(self, save_window_seconds: _Optional[float] = ..., flush_seconds: _Optional[float] = ...) -> None: ...

class PreemptResponse(_message.Message):
    __slots__ = ("notice_step", "started")
    NOTICE_STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    notice_step: int
    started: bool
    def __init__(self, notice_step: _Optional[int] = ..., started: _Optional[bool] = ...) -> None: ...

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

class LocalPiece(_message.Message):
    __slots__ = ("owner_rank", "step")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class LocalTask(_message.Message):
    __slots__ = ("kind", "owner_rank", "step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    owner_rank: int
    step: int
    def __init__(self, kind: _Optional[str] = ..., owner_rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class GetLocalStatusResponse(_message.Message):
    __slots__ = ("job", "rank", "nodes", "address", "metrics_address", "own_steps", "peer_steps", "newest_complete_step", "in_flight", "counters", "recent_errors", "has_backup", "backup_uploaded_bytes", "backup_last_error", "last_restore", "last_handshake")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OWN_STEPS_FIELD_NUMBER: _ClassVar[int]
    PEER_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    HAS_BACKUP_FIELD_NUMBER: _ClassVar[int]
    BACKUP_UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKUP_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    LAST_HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    nodes: int
    address: str
    metrics_address: str
    own_steps: _containers.RepeatedScalarFieldContainer[int]
    peer_steps: _containers.RepeatedCompositeFieldContainer[LocalPiece]
    newest_complete_step: int
    in_flight: _containers.RepeatedCompositeFieldContainer[LocalTask]
    counters: _containers.ScalarMap[str, int]
    recent_errors: _containers.RepeatedScalarFieldContainer[str]
    has_backup: bool
    backup_uploaded_bytes: int
    backup_last_error: str
    last_restore: _tier_pb2.RestoreBreakdown
    last_handshake: _tier_pb2.HandshakeBreakdown
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., nodes: _Optional[int] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., own_steps: _Optional[_Iterable[int]] = ..., peer_steps: _Optional[_Iterable[_Union[LocalPiece, _Mapping]]] = ..., newest_complete_step: _Optional[int] = ..., in_flight: _Optional[_Iterable[_Union[LocalTask, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., recent_errors: _Optional[_Iterable[str]] = ..., has_backup: _Optional[bool] = ..., backup_uploaded_bytes: _Optional[int] = ..., backup_last_error: _Optional[str] = ..., last_restore: _Optional[_Union[_tier_pb2.RestoreBreakdown, _Mapping]] = ..., last_handshake: _Optional[_Union[_tier_pb2.HandshakeBreakdown, _Mapping]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LocateStepRequest(_message.Message):
    __slots__ = ("step", "owners")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    owners: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., owners: _Optional[_Iterable[int]] = ...) -> None: ...

class RankSources(_message.Message):
    __slots__ = ("owner_rank", "sources")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    sources: _containers.RepeatedCompositeFieldContainer[RestoreSource]
    def __init__(self, owner_rank: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[RestoreSource, _Mapping]]] = ...) -> None: ...

class LocateStepResponse(_message.Message):
    __slots__ = ("savers", "generation", "ranks", "complete")
    SAVERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    savers: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankSources]
    complete: bool
    def __init__(self, savers: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankSources, _Mapping]]] = ..., complete: _Optional[bool] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("owner_rank", "step", "content_hash", "size", "tier", "generation", "savers")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAVERS_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    content_hash: str
    size: int
    tier: str
    generation: int
    savers: _containers.RepeatedCompositeFieldContainer[RankRange]
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., content_hash: _Optional[str] = ..., size: _Optional[int] = ..., tier: _Optional[str] = ..., generation: _Optional[int] = ..., savers: _Optional[_Iterable[_Union[RankRange, _Mapping]]] = ...) -> None: ...

class RankRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class BackupReport(_message.Message):
    __slots__ = ("step", "uploaded_ranks", "error")
    STEP_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step: int
    uploaded_ranks: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, step: _Optional[int] = ..., uploaded_ranks: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job", "rank", "incarnation", "address", "holdings", "backups", "backup_requests", "newest_saved_step", "preempting")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SAVED_STEP_FIELD_NUMBER: _ClassVar[int]
    PREEMPTING_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    incarnation: int
    address: str
    holdings: _containers.RepeatedCompositeFieldContainer[Holding]
    backups: _containers.RepeatedCompositeFieldContainer[BackupReport]
    backup_requests: _containers.RepeatedScalarFieldContainer[int]
    newest_saved_step: int
    preempting: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., address: _Optional[str] = ..., holdings: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ..., backups: _Optional[_Iterable[_Union[BackupReport, _Mapping]]] = ..., backup_requests: _Optional[_Iterable[int]] = ..., newest_saved_step: _Optional[int] = ..., preempting: _Optional[bool] = ...) -> None: ...

class CopyTask(_message.Message):
    __slots__ = ("owner_rank", "step", "source_rank", "source_address", "content_hash")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    source_rank: int
    source_address: str
    content_hash: str
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., source_rank: _Optional[int] = ..., source_address: _Optional[str] = ..., content_hash: _Optional[str] = ...) -> None: ...

class Deletion(_message.Message):
    __slots__ = ("owner_rank", "step")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreSource(_message.Message):
    __slots__ = ("kind", "holder_rank", "holder_address", "owner_rank", "content_hash")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    holder_rank: int
    holder_address: str
    owner_rank: int
    content_hash: str
    def __init__(self, kind: _Optional[str] = ..., holder_rank: _Optional[int] = ..., holder_address: _Optional[str] = ..., owner_rank: _Optional[int] = ..., content_hash: _Optional[str] = ...) -> None: ...

class RestoreTask(_message.Message):
    __slots__ = ("step", "sources")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    step: int
    sources: _containers.RepeatedCompositeFieldContainer[RestoreSource]
    def __init__(self, step: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[RestoreSource, _Mapping]]] = ...) -> None: ...

class BackupTask(_message.Message):
    __slots__ = ("step", "staging", "nodes", "ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    staging: str
    nodes: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., staging: _Optional[str] = ..., nodes: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("copies", "deletions", "restore", "backup", "newest_complete_step", "heartbeat_interval_ms", "preemption_noticed")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    DELETIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_NOTICED_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[CopyTask]
    deletions: _containers.RepeatedCompositeFieldContainer[Deletion]
    restore: RestoreTask
    backup: BackupTask
    newest_complete_step: int
    heartbeat_interval_ms: int
    preemption_noticed: bool
    def __init__(self, copies: _Optional[_Iterable[_Union[CopyTask, _Mapping]]] = ..., deletions: _Optional[_Iterable[_Union[Deletion, _Mapping]]] = ..., restore: _Optional[_Union[RestoreTask, _Mapping]] = ..., backup: _Optional[_Union[BackupTask, _Mapping]] = ..., newest_complete_step: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., preemption_noticed: _Optional[bool] = ...) -> None: ...

class GetStepsRequest(_message.Message):
    __slots__ = ("wait_seconds",)
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    wait_seconds: float
    def __init__(self, wait_seconds: _Optional[float] = ...) -> None: ...

class GetStepsResponse(_message.Message):
    __slots__ = ("newest_complete_step", "complete_steps", "backed_up_steps", "forced_restore_step")
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    newest_complete_step: int
    complete_steps: _containers.RepeatedScalarFieldContainer[int]
    backed_up_steps: _containers.RepeatedScalarFieldContainer[int]
    forced_restore_step: int
    def __init__(self, newest_complete_step: _Optional[int] = ..., complete_steps: _Optional[_Iterable[int]] = ..., backed_up_steps: _Optional[_Iterable[int]] = ..., forced_restore_step: _Optional[int] = ...) -> None: ...

class PrepareRestoreRequest(_message.Message):
    __slots__ = ("step", "wait_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    wait_seconds: float
    def __init__(self, step: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class PrepareRestoreResponse(_message.Message):
    __slots__ = ("step", "reason", "ready_ranks", "ready")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    READY_RANKS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    step: int
    reason: str
    ready_ranks: _containers.RepeatedScalarFieldContainer[int]
    ready: bool
    def __init__(self, step: _Optional[int] = ..., reason: _Optional[str] = ..., ready_ranks: _Optional[_Iterable[int]] = ..., ready: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

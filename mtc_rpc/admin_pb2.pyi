from mtc_rpc import tier_pb2 as _tier_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetSummaryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSummaryResponse(_message.Message):
    __slots__ = ("job", "nodes", "hosts_registered", "lost_ranks", "newest_complete_step", "newest_redundant", "pinned_steps", "restore_target", "backup_url", "newest_backup_step", "backup_last_success_unix", "backup_interval_seconds", "backup_interval_steps", "backup_skipped", "backup_failures", "backup_last_error", "backup_in_progress_step", "degraded", "problems", "newest_complete_bytes", "epoch", "last_restore", "last_restore_rank", "redundancy", "slowest_handshake", "slowest_handshake_rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOSTS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_REDUNDANT_FIELD_NUMBER: _ClassVar[int]
    PINNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TARGET_FIELD_NUMBER: _ClassVar[int]
    BACKUP_URL_FIELD_NUMBER: _ClassVar[int]
    NEWEST_BACKUP_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKUP_LAST_SUCCESS_UNIX_FIELD_NUMBER: _ClassVar[int]
    BACKUP_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BACKUP_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    BACKUP_IN_PROGRESS_STEP_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_RANK_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_HANDSHAKE_RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    nodes: int
    hosts_registered: int
    lost_ranks: _containers.RepeatedScalarFieldContainer[int]
    newest_complete_step: int
    newest_redundant: bool
    pinned_steps: _containers.RepeatedScalarFieldContainer[int]
    restore_target: int
    backup_url: str
    newest_backup_step: int
    backup_last_success_unix: float
    backup_interval_seconds: float
    backup_interval_steps: int
    backup_skipped: int
    backup_failures: int
    backup_last_error: str
    backup_in_progress_step: int
    degraded: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    newest_complete_bytes: int
    epoch: int
    last_restore: _tier_pb2.RestoreBreakdown
    last_restore_rank: int
    redundancy: str
    slowest_handshake: _tier_pb2.HandshakeBreakdown
    slowest_handshake_rank: int
    def __init__(self, job: _Optional[str] = ..., nodes: _Optional[int] = ..., hosts_registered: _Optional[int] = ..., lost_ranks: _Optional[_Iterable[int]] = ..., newest_complete_step: _Optional[int] = ..., newest_redundant: _Optional[bool] = ..., pinned_steps: _Optional[_Iterable[int]] = ..., restore_target: _Optional[int] = ..., backup_url: _Optional[str] = ..., newest_backup_step: _Optional[int] = ..., backup_last_success_unix: _Optional[float] = ..., backup_interval_seconds: _Optional[float] = ..., backup_interval_steps: _Optional[int] = ..., backup_skipped: _Optional[int] = ..., backup_failures: _Optional[int] = ..., backup_last_error: _Optional[str] = ..., backup_in_progress_step: _Optional[int] = ..., degraded: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ..., newest_complete_bytes: _Optional[int] = ..., epoch: _Optional[int] = ..., last_restore: _Optional[_Union[_tier_pb2.RestoreBreakdown, _Mapping]] = ..., last_restore_rank: _Optional[int] = ..., redundancy: _Optional[str] = ..., slowest_handshake: _Optional[_Union[_tier_pb2.HandshakeBreakdown, _Mapping]] = ..., slowest_handshake_rank: _Optional[int] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("step", "complete", "redundant", "pinned", "backing_up", "backed_up", "local_ranks", "peer_ranks", "bucket_ranks", "missing_ranks", "bytes", "first_seen_unix", "backup_unix", "restore_target", "complete_unix")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    BACKING_UP_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    PEER_RANKS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    BACKUP_UNIX_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TARGET_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_UNIX_FIELD_NUMBER: _ClassVar[int]
    step: int
    complete: bool
    redundant: bool
    pinned: bool
    backing_up: bool
    backed_up: bool
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    peer_ranks: _containers.RepeatedScalarFieldContainer[int]
    bucket_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    first_seen_unix: float
    backup_unix: float
    restore_target: bool
    complete_unix: float
    def __init__(self, step: _Optional[int] = ..., complete: _Optional[bool] = ..., redundant: _Optional[bool] = ..., pinned: _Optional[bool] = ..., backing_up: _Optional[bool] = ..., backed_up: _Optional[bool] = ..., local_ranks: _Optional[_Iterable[int]] = ..., peer_ranks: _Optional[_Iterable[int]] = ..., bucket_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., first_seen_unix: _Optional[float] = ..., backup_unix: _Optional[float] = ..., restore_target: _Optional[bool] = ..., complete_unix: _Optional[float] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("job", "nodes", "newest_complete_step", "steps", "epoch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    nodes: int
    newest_complete_step: int
    steps: _containers.RepeatedCompositeFieldContainer[StepInfo]
    epoch: int
    def __init__(self, job: _Optional[str] = ..., nodes: _Optional[int] = ..., newest_complete_step: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepInfo, _Mapping]]] = ..., epoch: _Optional[int] = ...) -> None: ...

class ListHostsRequest(_message.Message):
    __slots__ = ("first_rank", "last_rank")
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_RANK_FIELD_NUMBER: _ClassVar[int]
    first_rank: int
    last_rank: int
    def __init__(self, first_rank: _Optional[int] = ..., last_rank: _Optional[int] = ...) -> None: ...

class HostInfo(_message.Message):
    __slots__ = ("rank", "address", "incarnation", "seconds_since_report", "lost", "steps", "pieces", "bytes", "last_restore", "last_handshake")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    LAST_HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    incarnation: int
    seconds_since_report: float
    lost: bool
    steps: _containers.RepeatedScalarFieldContainer[int]
    pieces: int
    bytes: int
    last_restore: _tier_pb2.RestoreBreakdown
    last_handshake: _tier_pb2.HandshakeBreakdown
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., seconds_since_report: _Optional[float] = ..., lost: _Optional[bool] = ..., steps: _Optional[_Iterable[int]] = ..., pieces: _Optional[int] = ..., bytes: _Optional[int] = ..., last_restore: _Optional[_Union[_tier_pb2.RestoreBreakdown, _Mapping]] = ..., last_handshake: _Optional[_Union[_tier_pb2.HandshakeBreakdown, _Mapping]] = ...) -> None: ...

class ListHostsResponse(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostInfo]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostInfo, _Mapping]]] = ...) -> None: ...

class LocateStepRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("owner_rank", "holder_rank", "address", "tier", "content_hash", "size")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    holder_rank: int
    address: str
    tier: _tier_pb2.Tier
    content_hash: str
    size: int
    def __init__(self, owner_rank: _Optional[int] = ..., holder_rank: _Optional[int] = ..., address: _Optional[str] = ..., tier: _Optional[_Union[_tier_pb2.Tier, str]] = ..., content_hash: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class RankData(_message.Message):
    __slots__ = ("rank", "owner_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    owner_rank: int
    def __init__(self, rank: _Optional[int] = ..., owner_rank: _Optional[int] = ...) -> None: ...

class LocateStepResponse(_message.Message):
    __slots__ = ("job", "nodes", "step", "pieces", "backup_url", "ranks")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    BACKUP_URL_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job: str
    nodes: int
    step: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    backup_url: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankData]
    def __init__(self, job: _Optional[str] = ..., nodes: _Optional[int] = ..., step: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., backup_url: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankData, _Mapping]]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned_steps",)
    PINNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    pinned_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pinned_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreStepRequest(_message.Message):
    __slots__ = ("step", "wait_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    wait_seconds: float
    def __init__(self, step: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class RestoreStepResponse(_message.Message):
    __slots__ = ("step", "nodes", "ready_ranks", "ready", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    READY_RANKS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    nodes: int
    ready_ranks: _containers.RepeatedScalarFieldContainer[int]
    ready: bool
    reason: str
    def __init__(self, step: _Optional[int] = ..., nodes: _Optional[int] = ..., ready_ranks: _Optional[_Iterable[int]] = ..., ready: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class BackupNowRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class BackupNowResponse(_message.Message):
    __slots__ = ("step", "state")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    state: str
    def __init__(self, step: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class GcPlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GcItem(_message.Message):
    __slots__ = ("tier", "holder_rank", "owner_rank", "step", "size", "reason")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tier: _tier_pb2.Tier
    holder_rank: int
    owner_rank: int
    step: int
    size: int
    reason: str
    def __init__(self, tier: _Optional[_Union[_tier_pb2.Tier, str]] = ..., holder_rank: _Optional[int] = ..., owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., size: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GcPlanResponse(_message.Message):
    __slots__ = ("items", "protected_steps")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GcItem]
    protected_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, items: _Optional[_Iterable[_Union[GcItem, _Mapping]]] = ..., protected_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportBadCopyRequest(_message.Message):
    __slots__ = ("step", "owner_rank", "holder_rank", "tier", "file")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    step: int
    owner_rank: int
    holder_rank: int
    tier: _tier_pb2.Tier
    file: str
    def __init__(self, step: _Optional[int] = ..., owner_rank: _Optional[int] = ..., holder_rank: _Optional[int] = ..., tier: _Optional[_Union[_tier_pb2.Tier, str]] = ..., file: _Optional[str] = ...) -> None: ...

class ReportBadCopyResponse(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: str
    def __init__(self, action: _Optional[str] = ...) -> None: ...

from mtc_rpc import tier_pb2 as _tier_pb2
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

class OwnerSources(_message.Message):
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
    ranks: _containers.RepeatedCompositeFieldContainer[OwnerSources]
    complete: bool
    def __init__(self, savers: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[OwnerSources, _Mapping]]] = ..., complete: _Optional[bool] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("owner_rank", "step", "content_hash", "size", "tier", "generation", "savers", "group")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAVERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    content_hash: str
    size: int
    tier: _tier_pb2.Tier
    generation: int
    savers: _containers.RepeatedCompositeFieldContainer[RankRange]
    group: CodeGroup
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., content_hash: _Optional[str] = ..., size: _Optional[int] = ..., tier: _Optional[_Union[_tier_pb2.Tier, str]] = ..., generation: _Optional[int] = ..., savers: _Optional[_Iterable[_Union[RankRange, _Mapping]]] = ..., group: _Optional[_Union[CodeGroup, _Mapping]] = ...) -> None: ...

class CodeGroup(_message.Message):
    __slots__ = ("k", "m", "members", "content_hashes", "addresses")
    K_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    k: int
    m: int
    members: _containers.RepeatedScalarFieldContainer[int]
    content_hashes: _containers.RepeatedScalarFieldContainer[str]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, k: _Optional[int] = ..., m: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., content_hashes: _Optional[_Iterable[str]] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ParityTask(_message.Message):
    __slots__ = ("step", "group")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    step: int
    group: CodeGroup
    def __init__(self, step: _Optional[int] = ..., group: _Optional[_Union[CodeGroup, _Mapping]] = ...) -> None: ...

class RankRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class BackupReport(_message.Message):
    __slots__ = ("step", "uploaded_ranks", "error", "staging")
    STEP_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    step: int
    uploaded_ranks: _containers.RepeatedScalarFieldContainer[int]
    error: str
    staging: str
    def __init__(self, step: _Optional[int] = ..., uploaded_ranks: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., staging: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job", "rank", "incarnation", "address", "holdings", "backups", "backup_requests", "newest_saved_step", "inventory_digest", "full_report", "base_digest", "removed", "known_epoch", "preempting", "nodes", "last_restore", "report_seq", "last_handshake")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SAVED_STEP_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FULL_REPORT_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREEMPTING_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LAST_RESTORE_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    incarnation: int
    address: str
    holdings: _containers.RepeatedCompositeFieldContainer[Holding]
    backups: _containers.RepeatedCompositeFieldContainer[BackupReport]
    backup_requests: _containers.RepeatedScalarFieldContainer[int]
    newest_saved_step: int
    inventory_digest: str
    full_report: bool
    base_digest: str
    removed: _containers.RepeatedCompositeFieldContainer[Deletion]
    known_epoch: int
    preempting: bool
    nodes: int
    last_restore: _tier_pb2.RestoreBreakdown
    report_seq: int
    last_handshake: _tier_pb2.HandshakeBreakdown
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., address: _Optional[str] = ..., holdings: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ..., backups: _Optional[_Iterable[_Union[BackupReport, _Mapping]]] = ..., backup_requests: _Optional[_Iterable[int]] = ..., newest_saved_step: _Optional[int] = ..., inventory_digest: _Optional[str] = ..., full_report: _Optional[bool] = ..., base_digest: _Optional[str] = ..., removed: _Optional[_Iterable[_Union[Deletion, _Mapping]]] = ..., known_epoch: _Optional[int] = ..., preempting: _Optional[bool] = ..., nodes: _Optional[int] = ..., last_restore: _Optional[_Union[_tier_pb2.RestoreBreakdown, _Mapping]] = ..., report_seq: _Optional[int] = ..., last_handshake: _Optional[_Union[_tier_pb2.HandshakeBreakdown, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("owner_rank", "step", "content_hash", "tier")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    content_hash: str
    tier: _tier_pb2.Tier
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., content_hash: _Optional[str] = ..., tier: _Optional[_Union[_tier_pb2.Tier, str]] = ...) -> None: ...

class RestoreSource(_message.Message):
    __slots__ = ("kind", "holder_rank", "holder_address", "owner_rank", "content_hash", "group")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    kind: _tier_pb2.Tier
    holder_rank: int
    holder_address: str
    owner_rank: int
    content_hash: str
    group: CodeGroup
    def __init__(self, kind: _Optional[_Union[_tier_pb2.Tier, str]] = ..., holder_rank: _Optional[int] = ..., holder_address: _Optional[str] = ..., owner_rank: _Optional[int] = ..., content_hash: _Optional[str] = ..., group: _Optional[_Union[CodeGroup, _Mapping]] = ...) -> None: ...

class RestoreTask(_message.Message):
    __slots__ = ("step", "sources")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    step: int
    sources: _containers.RepeatedCompositeFieldContainer[RestoreSource]
    def __init__(self, step: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[RestoreSource, _Mapping]]] = ...) -> None: ...

class BackupTask(_message.Message):
    __slots__ = ("step", "staging", "nodes", "ranks", "source_owner_ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_OWNER_RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    staging: str
    nodes: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    source_owner_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., staging: _Optional[str] = ..., nodes: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., source_owner_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("copies", "deletions", "restore", "backup", "newest_complete_step", "heartbeat_interval_ms", "acked_digest", "epoch", "preemption_noticed", "parity")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    DELETIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ACKED_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_NOTICED_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[CopyTask]
    deletions: _containers.RepeatedCompositeFieldContainer[Deletion]
    restore: RestoreTask
    backup: BackupTask
    newest_complete_step: int
    heartbeat_interval_ms: int
    acked_digest: str
    epoch: int
    preemption_noticed: bool
    parity: _containers.RepeatedCompositeFieldContainer[ParityTask]
    def __init__(self, copies: _Optional[_Iterable[_Union[CopyTask, _Mapping]]] = ..., deletions: _Optional[_Iterable[_Union[Deletion, _Mapping]]] = ..., restore: _Optional[_Union[RestoreTask, _Mapping]] = ..., backup: _Optional[_Union[BackupTask, _Mapping]] = ..., newest_complete_step: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., acked_digest: _Optional[str] = ..., epoch: _Optional[int] = ..., preemption_noticed: _Optional[bool] = ..., parity: _Optional[_Iterable[_Union[ParityTask, _Mapping]]] = ...) -> None: ...

class GetStepsRequest(_message.Message):
    __slots__ = ("wait_seconds", "min_step", "gone_ranks", "asker_rank")
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    GONE_RANKS_FIELD_NUMBER: _ClassVar[int]
    ASKER_RANK_FIELD_NUMBER: _ClassVar[int]
    wait_seconds: float
    min_step: int
    gone_ranks: _containers.RepeatedScalarFieldContainer[int]
    asker_rank: int
    def __init__(self, wait_seconds: _Optional[float] = ..., min_step: _Optional[int] = ..., gone_ranks: _Optional[_Iterable[int]] = ..., asker_rank: _Optional[int] = ...) -> None: ...

class GetStepsResponse(_message.Message):
    __slots__ = ("newest_complete_step", "complete_steps", "backed_up_steps", "forced_restore_step", "epoch")
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_STEPS_FIELD_NUMBER: _ClassVar[int]
    FORCED_RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    newest_complete_step: int
    complete_steps: _containers.RepeatedScalarFieldContainer[int]
    backed_up_steps: _containers.RepeatedScalarFieldContainer[int]
    forced_restore_step: int
    epoch: int
    def __init__(self, newest_complete_step: _Optional[int] = ..., complete_steps: _Optional[_Iterable[int]] = ..., backed_up_steps: _Optional[_Iterable[int]] = ..., forced_restore_step: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PrepareRestoreRequest(_message.Message):
    __slots__ = ("step", "wait_seconds", "nodes", "gone_ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GONE_RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    wait_seconds: float
    nodes: int
    gone_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., nodes: _Optional[int] = ..., gone_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareRestoreResponse(_message.Message):
    __slots__ = ("step", "reason", "ready_ranks", "ready", "lost_ranks", "unreachable", "epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    READY_RANKS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    reason: str
    ready_ranks: _containers.RepeatedScalarFieldContainer[int]
    ready: bool
    lost_ranks: _containers.RepeatedScalarFieldContainer[int]
    unreachable: str
    epoch: int
    def __init__(self, step: _Optional[int] = ..., reason: _Optional[str] = ..., ready_ranks: _Optional[_Iterable[int]] = ..., ready: _Optional[bool] = ..., lost_ranks: _Optional[_Iterable[int]] = ..., unreachable: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("hosts", "detail_steps", "rank_first", "rank_count", "nodes")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIRST_FIELD_NUMBER: _ClassVar[int]
    RANK_COUNT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    hosts: bool
    detail_steps: _containers.RepeatedScalarFieldContainer[int]
    rank_first: int
    rank_count: int
    nodes: int
    def __init__(self, hosts: _Optional[bool] = ..., detail_steps: _Optional[_Iterable[int]] = ..., rank_first: _Optional[int] = ..., rank_count: _Optional[int] = ..., nodes: _Optional[int] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("nodes", "data_parallelism", "replicas")
    NODES_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    data_parallelism: int
    replicas: int
    def __init__(self, nodes: _Optional[int] = ..., data_parallelism: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step", "complete", "redundant", "ranks_covered", "missing_ranks", "ranks_backed_up", "backed_up", "pinned", "backing_up", "savers")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_FIELD_NUMBER: _ClassVar[int]
    RANKS_COVERED_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_BACKED_UP_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    BACKING_UP_FIELD_NUMBER: _ClassVar[int]
    SAVERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    complete: bool
    redundant: bool
    ranks_covered: int
    missing_ranks: str
    ranks_backed_up: int
    backed_up: bool
    pinned: bool
    backing_up: bool
    savers: str
    def __init__(self, step: _Optional[int] = ..., complete: _Optional[bool] = ..., redundant: _Optional[bool] = ..., ranks_covered: _Optional[int] = ..., missing_ranks: _Optional[str] = ..., ranks_backed_up: _Optional[int] = ..., backed_up: _Optional[bool] = ..., pinned: _Optional[bool] = ..., backing_up: _Optional[bool] = ..., savers: _Optional[str] = ...) -> None: ...

class SourceInfo(_message.Message):
    __slots__ = ("kind", "holder_rank", "owner_rank")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOLDER_RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    kind: _tier_pb2.Tier
    holder_rank: int
    owner_rank: int
    def __init__(self, kind: _Optional[_Union[_tier_pb2.Tier, str]] = ..., holder_rank: _Optional[int] = ..., owner_rank: _Optional[int] = ...) -> None: ...

class RankSources(_message.Message):
    __slots__ = ("rank", "sources")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceInfo]
    def __init__(self, rank: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceInfo, _Mapping]]] = ...) -> None: ...

class StepDetail(_message.Message):
    __slots__ = ("step", "ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankSources]
    def __init__(self, step: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankSources, _Mapping]]] = ...) -> None: ...

class HostStatus(_message.Message):
    __slots__ = ("rank", "address", "incarnation", "inventory_reported", "last_report_age_seconds", "lost", "lost_for_seconds", "steps", "pieces", "bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_REPORTED_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    LOST_FOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    incarnation: int
    inventory_reported: bool
    last_report_age_seconds: float
    lost: bool
    lost_for_seconds: float
    steps: _containers.RepeatedScalarFieldContainer[int]
    pieces: int
    bytes: int
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., inventory_reported: _Optional[bool] = ..., last_report_age_seconds: _Optional[float] = ..., lost: _Optional[bool] = ..., lost_for_seconds: _Optional[float] = ..., steps: _Optional[_Iterable[int]] = ..., pieces: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class LostHosts(_message.Message):
    __slots__ = ("ranks", "lost_for_seconds")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LOST_FOR_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ranks: str
    lost_for_seconds: float
    def __init__(self, ranks: _Optional[str] = ..., lost_for_seconds: _Optional[float] = ...) -> None: ...

class BackupStatus(_message.Message):
    __slots__ = ("url", "committed_steps", "in_progress_step", "in_progress_done_ranks", "skipped", "failures", "last_error", "interval_steps", "interval_minutes", "keep")
    URL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_STEP_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_DONE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MINUTES_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    url: str
    committed_steps: _containers.RepeatedScalarFieldContainer[int]
    in_progress_step: int
    in_progress_done_ranks: int
    skipped: int
    failures: int
    last_error: str
    interval_steps: int
    interval_minutes: float
    keep: int
    def __init__(self, url: _Optional[str] = ..., committed_steps: _Optional[_Iterable[int]] = ..., in_progress_step: _Optional[int] = ..., in_progress_done_ranks: _Optional[int] = ..., skipped: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., interval_steps: _Optional[int] = ..., interval_minutes: _Optional[float] = ..., keep: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("job", "topology", "epoch", "coordinator_address", "newest_complete_step", "complete_steps", "backed_up_steps", "restore_target", "pinned_steps", "backing_up_steps", "hosts_registered", "hosts_reported", "hosts_lost", "lost_ranks", "lost", "hosts_reregistered", "heartbeat_interval_seconds", "host_lost_seconds", "steps", "backup", "hosts", "step_details", "redundancy")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TARGET_FIELD_NUMBER: _ClassVar[int]
    PINNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKING_UP_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOSTS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HOSTS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    HOSTS_LOST_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    HOSTS_REREGISTERED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    STEP_DETAILS_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_FIELD_NUMBER: _ClassVar[int]
    job: str
    topology: Topology
    epoch: int
    coordinator_address: str
    newest_complete_step: int
    complete_steps: _containers.RepeatedScalarFieldContainer[int]
    backed_up_steps: _containers.RepeatedScalarFieldContainer[int]
    restore_target: int
    pinned_steps: _containers.RepeatedScalarFieldContainer[int]
    backing_up_steps: _containers.RepeatedScalarFieldContainer[int]
    hosts_registered: int
    hosts_reported: int
    hosts_lost: int
    lost_ranks: str
    lost: _containers.RepeatedCompositeFieldContainer[LostHosts]
    hosts_reregistered: int
    heartbeat_interval_seconds: float
    host_lost_seconds: float
    steps: _containers.RepeatedCompositeFieldContainer[StepSummary]
    backup: BackupStatus
    hosts: _containers.RepeatedCompositeFieldContainer[HostStatus]
    step_details: _containers.RepeatedCompositeFieldContainer[StepDetail]
    redundancy: str
    def __init__(self, job: _Optional[str] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., epoch: _Optional[int] = ..., coordinator_address: _Optional[str] = ..., newest_complete_step: _Optional[int] = ..., complete_steps: _Optional[_Iterable[int]] = ..., backed_up_steps: _Optional[_Iterable[int]] = ..., restore_target: _Optional[int] = ..., pinned_steps: _Optional[_Iterable[int]] = ..., backing_up_steps: _Optional[_Iterable[int]] = ..., hosts_registered: _Optional[int] = ..., hosts_reported: _Optional[int] = ..., hosts_lost: _Optional[int] = ..., lost_ranks: _Optional[str] = ..., lost: _Optional[_Iterable[_Union[LostHosts, _Mapping]]] = ..., hosts_reregistered: _Optional[int] = ..., heartbeat_interval_seconds: _Optional[float] = ..., host_lost_seconds: _Optional[float] = ..., steps: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., backup: _Optional[_Union[BackupStatus, _Mapping]] = ..., hosts: _Optional[_Iterable[_Union[HostStatus, _Mapping]]] = ..., step_details: _Optional[_Iterable[_Union[StepDetail, _Mapping]]] = ..., redundancy: _Optional[str] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_LOCAL: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_REPLICA: _ClassVar[Tier]
    TIER_BUCKET: _ClassVar[Tier]
    TIER_PARITY: _ClassVar[Tier]

class RestorePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTORE_PHASE_UNSPECIFIED: _ClassVar[RestorePhase]
    RESTORE_PHASE_PLAN: _ClassVar[RestorePhase]
    RESTORE_PHASE_FETCH: _ClassVar[RestorePhase]
    RESTORE_PHASE_VERIFY: _ClassVar[RestorePhase]
    RESTORE_PHASE_LOAD: _ClassVar[RestorePhase]
TIER_UNSPECIFIED: Tier
TIER_LOCAL: Tier
TIER_PEER: Tier
TIER_REPLICA: Tier
TIER_BUCKET: Tier
TIER_PARITY: Tier
RESTORE_PHASE_UNSPECIFIED: RestorePhase
RESTORE_PHASE_PLAN: RestorePhase
RESTORE_PHASE_FETCH: RestorePhase
RESTORE_PHASE_VERIFY: RestorePhase
RESTORE_PHASE_LOAD: RestorePhase

class RestorePhaseTime(_message.Message):
    __slots__ = ("phase", "tier", "seconds")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: RestorePhase
    tier: Tier
    seconds: float
    def __init__(self, phase: _Optional[_Union[RestorePhase, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., seconds: _Optional[float] = ...) -> None: ...

class RestoreBreakdown(_message.Message):
    __slots__ = ("step", "owner_rank", "tier", "bytes", "phases", "seconds", "finished_unix", "trigger")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    step: int
    owner_rank: int
    tier: Tier
    bytes: int
    phases: _containers.RepeatedCompositeFieldContainer[RestorePhaseTime]
    seconds: float
    finished_unix: float
    trigger: str
    def __init__(self, step: _Optional[int] = ..., owner_rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., bytes: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[RestorePhaseTime, _Mapping]]] = ..., seconds: _Optional[float] = ..., finished_unix: _Optional[float] = ..., trigger: _Optional[str] = ...) -> None: ...

class HandshakePhaseTime(_message.Message):
    __slots__ = ("phase", "seconds")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    seconds: float
    def __init__(self, phase: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class HandshakeBreakdown(_message.Message):
    __slots__ = ("number", "seconds", "phases", "finished_unix", "outcome")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    number: int
    seconds: float
    phases: _containers.RepeatedCompositeFieldContainer[HandshakePhaseTime]
    finished_unix: float
    outcome: str
    def __init__(self, number: _Optional[int] = ..., seconds: _Optional[float] = ..., phases: _Optional[_Iterable[_Union[HandshakePhaseTime, _Mapping]]] = ..., finished_unix: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

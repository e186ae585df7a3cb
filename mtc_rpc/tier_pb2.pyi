from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_LOCAL: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_REPLICA: _ClassVar[Tier]
    TIER_BUCKET: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_LOCAL: Tier
TIER_PEER: Tier
TIER_REPLICA: Tier
TIER_BUCKET: Tier

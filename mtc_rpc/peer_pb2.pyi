from mtc_rpc import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListStepsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeldStep(_message.Message):
    __slots__ = ("owner_rank", "step", "content_hash", "total_bytes", "kind", "file_count")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FILE_COUNT_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    step: int
    content_hash: str
    total_bytes: int
    kind: str
    file_count: int
    def __init__(self, owner_rank: _Optional[int] = ..., step: _Optional[int] = ..., content_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., kind: _Optional[str] = ..., file_count: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("own_rank", "nodes", "steps")
    OWN_RANK_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    own_rank: int
    nodes: int
    steps: _containers.RepeatedCompositeFieldContainer[HeldStep]
    def __init__(self, own_rank: _Optional[int] = ..., nodes: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[HeldStep, _Mapping]]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("rank", "step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: bytes
    def __init__(self, manifest_json: _Optional[bytes] = ...) -> None: ...

class OpenTransferRequest(_message.Message):
    __slots__ = ("rank", "step", "files", "pieces", "parity")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    files: _containers.RepeatedScalarFieldContainer[str]
    pieces: _containers.RepeatedCompositeFieldContainer[TransferPiece]
    parity: str
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., pieces: _Optional[_Iterable[_Union[TransferPiece, _Mapping]]] = ..., parity: _Optional[str] = ...) -> None: ...

class TransferPiece(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class TransferFile(_message.Message):
    __slots__ = ("name", "size", "crc32c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    crc32c: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ...) -> None: ...

class OpenTransferResponse(_message.Message):
    __slots__ = ("ticket", "data_port", "files", "expires_in_ms", "data_host")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_port: int
    files: _containers.RepeatedCompositeFieldContainer[TransferFile]
    expires_in_ms: int
    data_host: str
    def __init__(self, ticket: _Optional[bytes] = ..., data_port: _Optional[int] = ..., files: _Optional[_Iterable[_Union[TransferFile, _Mapping]]] = ..., expires_in_ms: _Optional[int] = ..., data_host: _Optional[str] = ...) -> None: ...

class ReadFilesRequest(_message.Message):
    __slots__ = ("rank", "step", "files", "chunk_bytes", "pieces", "parity")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    files: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    pieces: _containers.RepeatedCompositeFieldContainer[TransferPiece]
    parity: str
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[TransferPiece, _Mapping]]] = ..., parity: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("file_index", "offset", "data", "crc32c", "name", "file_size")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    offset: int
    data: bytes
    crc32c: int
    name: str
    file_size: int
    def __init__(self, file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., name: _Optional[str] = ..., file_size: _Optional[int] = ...) -> None: ...

class RebuildFragmentsRequest(_message.Message):
    __slots__ = ("step", "group", "rank", "fragments", "lost", "chain", "chain_at", "chain_crc32c")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    CHAIN_AT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_CRC32C_FIELD_NUMBER: _ClassVar[int]
    step: int
    group: _coordinator_pb2.CodeGroup
    rank: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentRef]
    lost: _containers.RepeatedScalarFieldContainer[int]
    chain: _containers.RepeatedScalarFieldContainer[int]
    chain_at: int
    chain_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., group: _Optional[_Union[_coordinator_pb2.CodeGroup, _Mapping]] = ..., rank: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentRef, _Mapping]]] = ..., lost: _Optional[_Iterable[int]] = ..., chain: _Optional[_Iterable[int]] = ..., chain_at: _Optional[int] = ..., chain_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class FragmentRef(_message.Message):
    __slots__ = ("rotation", "stripe", "index")
    ROTATION_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    rotation: int
    stripe: int
    index: int
    def __init__(self, rotation: _Optional[int] = ..., stripe: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

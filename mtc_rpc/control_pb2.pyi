from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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

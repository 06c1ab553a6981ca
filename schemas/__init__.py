"""Message models and wire format of Relax-bus. Depends on pydantic and msgpack only."""

from schemas.codec import decode, encode, peek_kind
from schemas.errors import (
    InvalidMessage,
    MalformedPayload,
    SchemaError,
    TensorError,
    UnknownKind,
    UnknownSchemaVersion,
)
from schemas.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    DeadLetter,
    Message,
    Metric,
    PromptGroup,
    RewardDetail,
    RolloutGroup,
    RolloutTimings,
    RunEvent,
    Sample,
    ScoredGroup,
    TrainGroup,
    WeightsAnnouncement,
    WorkerHeartbeat,
)
from schemas.parts import AudioPart, ImagePart, MediaRef, Part, TextPart, VideoPart
from schemas.tensor import WireTensor

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_VERSION",
    "AudioPart",
    "DeadLetter",
    "ImagePart",
    "InvalidMessage",
    "MalformedPayload",
    "MediaRef",
    "Message",
    "Metric",
    "Part",
    "PromptGroup",
    "RewardDetail",
    "RolloutGroup",
    "RolloutTimings",
    "RunEvent",
    "Sample",
    "SchemaError",
    "ScoredGroup",
    "TensorError",
    "TextPart",
    "TrainGroup",
    "UnknownKind",
    "UnknownSchemaVersion",
    "VideoPart",
    "WeightsAnnouncement",
    "WireTensor",
    "WorkerHeartbeat",
    "decode",
    "encode",
    "peek_kind",
]

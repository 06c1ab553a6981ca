"""Errors raised while encoding or decoding bus messages."""


class SchemaError(Exception):
    """Base class: a payload could not be turned into (or from) a message."""


class MalformedPayload(SchemaError):
    """Raised when the bytes are not a msgpack map, or are truncated or corrupt."""


class UnknownKind(SchemaError):
    """Raised when a payload's `kind` names no known message model."""


class UnknownSchemaVersion(SchemaError):
    """Raised when a payload's major schema version is not one this code understands."""


class InvalidMessage(SchemaError):
    """Raised when a payload decodes but its fields fail validation."""


class TensorError(SchemaError):
    """Raised when a wire tensor's dtype, shape and byte length disagree."""

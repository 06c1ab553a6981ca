"""What a handler is given and returns, and the knobs and counters of the worker loop that calls it."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from schemas import Message

if TYPE_CHECKING:
    from relax_bus.topology import StreamSpec

In = TypeVar("In", bound=Message)
HandlerResult = Message | Sequence[Message] | None


@dataclass(frozen=True)
class Delivery:
    """What a handler may know about the delivery it is handling."""

    subject: str
    stream_seq: int
    deliveries: int
    """1 on the first delivery."""
    last_attempt: bool
    """True when a failure now dead-letters the message instead of redelivering it."""


Handler = Callable[[In, Delivery], Awaitable[HandlerResult]]


def foreign_subject(subject: str, stream: StreamSpec) -> str | None:
    """Why a message delivered from `stream` is not the stream's to hand out: it was stored under another
    subject (delivered into the stream by some other consumer), which a durable's filter should already have
    left out (None: it is the stream's)."""
    if subject == stream.subject:
        return None
    return f"message on subject {subject!r} in {stream.name}, not the hop's {stream.subject!r}"


@dataclass
class Counters:
    """What a worker has done since it started; written into its heartbeat."""

    received: int = 0
    processed: int = 0
    published: int = 0
    retried: int = 0
    dropped: int = 0
    skipped: int = 0
    dead_lettered: int = 0
    failed: int = 0
    output_full: int = 0
    """Publishes the output hop refused because it was full (the input was held and the publish tried again)."""


@dataclass
class WorkerOptions:
    """Knobs of one worker process."""

    concurrency: int = 1
    """Messages handled at once."""
    fetch_max_bytes: int = 16 << 20
    """Rough byte budget of one pull: the batch size adapts to the input's average message size."""
    fetch_timeout_s: float = 1.0
    """Longest a fetch waits for input (bounds how fast a stop is noticed)."""
    grace_s: float = 30.0
    """On stop, how long in-flight handlers may take before they are cancelled and their messages nak'd."""
    retry_backoff_s: tuple[float, ...] = (0.5, 2.0, 5.0, 10.0)
    """Redelivery delay after an unexpected handler failure, by delivery count."""
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")

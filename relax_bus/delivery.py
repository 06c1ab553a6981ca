"""What a handler is given and returns, and the knobs and counters of the worker loop that calls it."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from relax_bus import log
from schemas import Message

if TYPE_CHECKING:
    from relax_bus.topology import StreamSpec

_ROLE_WORKER_ID: ContextVar[str | None] = ContextVar("relax_role_worker_id", default=None)
"""The worker id of the role process this runs in (`role_worker`), which its loops take."""


def new_worker_id() -> str:
    """The worker id of the role this runs in (`role_worker`), else a fresh one."""
    return _ROLE_WORKER_ID.get() or _fresh_worker_id()


def _fresh_worker_id() -> str:
    """`<host>-<pid>-<6 hex digits>`: unique, and says where the worker runs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@contextlib.contextmanager
def role_worker(run: str, role: str) -> Iterator[str]:
    """Run the block as one worker of `role` in `run`: a worker id of its own, which the loops created in the block
    take (their heartbeat key, `relax inspect`'s worker), and `run`, `role` and `worker` on every log event of it
    (`relax_bus.log.bound`). A role process has one loop that runs for its role, so one id says who it is."""
    worker_id = _fresh_worker_id()
    token = _ROLE_WORKER_ID.set(worker_id)
    try:
        with log.bound(run=run, role=role, worker=worker_id):
            yield worker_id
    finally:
        _ROLE_WORKER_ID.reset(token)


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
    worker_id: str = field(default_factory=new_worker_id)
    """Who this worker is: `<role>.<worker_id>` keys its heartbeat. Default: the role process's (`role_worker`),
    else a fresh one."""

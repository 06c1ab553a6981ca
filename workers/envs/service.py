"""An environment class served on the bus: a `nats.micro` service whose instances share the run's reset subject.

Each serving process is one instance of the service `relax-env` (metadata: `run`, `environment`, the
instance id), with three endpoints on the run's subjects (`relax_bus.topology.EnvSubjects`):

    reset  relax.<run>.env.reset              {"episode", "item": {EnvItem}} -> {"instance", "observation",
                                              "deterministic"}; queue group `env`, so any instance answers
    step   relax.<run>.env.<instance>.step    {"episode", "action"} -> {"observation", "reward", "done", "info"}
    close  relax.<run>.env.<instance>.close   {"episode"} -> {"closed": bool}

An instance holds one environment object per episode it reset, until the episode is closed, is done, fails, or
stays idle past `idle_ttl_s`. A failure is a micro error reply (`Nats-Service-Error` and its code headers) with
a one-line text, never the end of the server: `404 unknown episode` (the client treats it as a lost instance),
`503` for a reset while the instance holds `max_episodes` (the client asks again, and the queue group may pick
another instance), `500` for an environment's exception, `504` for a call past `call_timeout_s`, `400` for a
request that is not the protocol's. Environment code runs in the server's own threads (`threads` of them), several
episodes at once; the steps of one episode run one at a time. `$SRV.PING/INFO/STATS` (`nats micro ls`,
`relax inspect`) list the instances with the requests, errors and average latency of each endpoint.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.micro.request import Request, ServiceError
from nats.micro.service import EndpointConfig, Service, ServiceConfig, ServiceStats

from relax_bus.cancel import cancel_and_wait
from relax_bus.log import get_logger
from relax_bus.topology import EnvSubjects, Topology, env_subjects
from workers.envs.base import Environment, EnvItem, StepResult, env_class, make_env

log = get_logger(__name__)

SERVICE_VERSION = "1.0.0"
"""The protocol's version, as the service reports it."""
BAD_REQUEST, UNKNOWN_EPISODE, ENV_ERROR, FULL, TIMED_OUT = "400", "404", "500", "503", "504"
"""The codes of the error replies (`Nats-Service-Error-Code`)."""
STOP_GRACE_S = 5.0
"""How long a stopping server lets the calls in flight finish before it cancels them."""


def new_instance_id() -> str:
    """A short id unique to one serving process (it names the instance's own subjects)."""
    return uuid.uuid4().hex[:12]


def one_line(err: BaseException) -> str:
    """An exception as one line of text: its type and the first line of its message."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@dataclass
class ServerLimits:
    """What one environment server instance allows."""

    call_timeout_s: float = 30.0
    """Longest one environment call (construct and reset, or step) may take before the episode fails."""
    idle_ttl_s: float = 600.0
    """An episode without a request for this long is dropped (its client died or forgot it)."""
    threads: int = 64
    """Environment calls run at once (a thread each): a slow tool's steps of different episodes overlap up to this
    many (the default executor would allow `cpus + 4`)."""
    max_episodes: int = 1024
    """Episodes held at once; a reset beyond them is refused (`503`), for another instance to take."""


@dataclass
class _Episode:
    env: Environment
    used_at: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Figures:
    """One endpoint's figures, as `$SRV.STATS` reports them (requests are answered concurrently, so the
    service's own per-callback accounting would time the hand-off only)."""

    requests: int = 0
    errors: int = 0
    answered: int = 0
    processing_ns: int = 0
    last_error: str = ""


class _Service(Service):
    """A micro service whose STATS report the server's own figures of each endpoint."""

    figures: dict[str, _Figures]

    def stats(self) -> ServiceStats:
        stats = super().stats()
        for endpoint in stats.endpoints:
            f = self.figures.get(endpoint.name)
            if f is not None:
                endpoint.num_requests, endpoint.num_errors = f.requests, f.errors
                endpoint.last_error = f.last_error or None
                endpoint.processing_time = f.processing_ns
                endpoint.average_processing_time = f.processing_ns // f.answered if f.answered else 0
        return stats


class EnvServer:
    """One instance of the environment service: the episodes it holds and the service that answers for them."""

    def __init__(
        self,
        nc: NATS,
        subjects: EnvSubjects,
        spec: str,
        options: dict[str, Any] | None = None,
        limits: ServerLimits | None = None,
        instance: str | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.spec = spec
        self.options = dict(options or {})
        self.limits = limits or ServerLimits()
        self.instance = instance or new_instance_id()
        self._threads = concurrent.futures.ThreadPoolExecutor(self.limits.threads, thread_name_prefix="env")
        self.episodes: dict[str, _Episode] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        """Episodes opened, steps taken, errors, evictions: written into the env role's heartbeat."""
        self.figures = {name: _Figures() for name in ("reset", "step", "close")}
        """Each endpoint's requests, errors and latency, as `$SRV.STATS` reports them."""
        self.service: _Service | None = None
        self._opening = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._evictor: asyncio.Task[None] | None = None

    async def start(self) -> EnvServer:
        """Check the environment (its class and options make an instance), then answer requests."""
        cls = env_class(self.spec)
        await asyncio.to_thread(make_env, self.spec, self.options)  # bad options fail here, not per episode
        config = ServiceConfig(
            name=self.subjects.service,
            version=SERVICE_VERSION,
            description=f"environment {self.spec} of run {self.subjects.run}",
            metadata={"run": self.subjects.run, "environment": self.spec, "instance": self.instance},
            queue_group=self.subjects.queue,
        )
        service = _Service(self.nc, config)
        service.figures = self.figures
        await service.start()
        self.service = service
        endpoints: dict[str, tuple[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]] = {
            "reset": (self.subjects.reset, self._reset),
            "step": (self.subjects.step(self.instance), self._step),
            "close": (self.subjects.close(self.instance), self._close),
        }
        for name, (subject, work) in endpoints.items():
            handler = self._concurrent(name, work)
            await service.add_endpoint(EndpointConfig(name=name, subject=subject, handler=handler))
        await self.nc.flush()
        self._evictor = asyncio.create_task(self._evict_idle(), name=f"env-evict:{self.instance}")
        log.info("env_serving", run=self.subjects.run, env=self.spec, cls=cls.__name__, instance=self.instance)
        return self

    async def stop(self) -> None:
        """Stop answering (the instance leaves the queue group at once); let the calls in flight finish for up to
        `STOP_GRACE_S`, then drop every episode it held."""
        service, self.service = self.service, None
        if service is not None and not self.nc.is_closed:
            try:
                await service.stop()
            except nats.errors.Error as err:  # tolerated: the connection closing under it unsubscribes anyway
                log.info("env_stop_unsubscribe_failed", instance=self.instance, error=one_line(err))
        if self._evictor is not None:
            await cancel_and_wait(self._evictor)
            self._evictor = None
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=STOP_GRACE_S)
            for task in late:
                await cancel_and_wait(task)
        for episode in list(self.episodes):
            self._drop(episode)
        self._threads.shutdown(wait=False, cancel_futures=True)  # a call past its timeout may still run: not waited
        log.info("env_stopped", instance=self.instance, **self.counts)

    # ------------------------------------------------------------ requests

    def _concurrent(
        self, name: str, work: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Callable[[Request], Awaitable[None]]:
        """A micro handler that answers each request in a task of its own: a slow environment call of one episode
        does not hold up the requests of the others."""

        async def handler(request: Request) -> None:
            task = asyncio.create_task(self._answer(name, request, work), name=f"env-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return handler

    async def _answer(
        self, name: str, request: Request, work: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> None:
        figures = self.figures[name]
        figures.requests += 1
        started = time.perf_counter_ns()
        try:
            try:
                body = json.loads(request.data)
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                raise ServiceError(BAD_REQUEST, f"bad request: {one_line(err)}") from None
            reply, error = json.dumps(await work(body)).encode(), None
        except ServiceError as err:
            reply, error = b"", err
        except Exception as err:  # deliberate: whatever the environment raises is its reply, never the server's end
            reply, error = b"", ServiceError(ENV_ERROR, one_line(err))
        if error is not None:
            figures.errors += 1
            figures.last_error = f"{error.code} {error.description}"
            self.counts["errors"] += 1
        try:
            if error is None:
                await request.respond(reply)
            else:
                await request.respond_error(error.code, error.description)
        except (nats.errors.Error, OSError, ValueError) as err:
            # Tolerated: a request without a reply subject, or a connection closing; the client times out.
            log.info("env_reply_lost", endpoint=name, error=one_line(err))
        figures.answered += 1
        figures.processing_ns += time.perf_counter_ns() - started

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """An environment call in a thread, bounded by `call_timeout_s` (the thread of one past it is left to end)."""
        try:
            call = asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args))
            return await asyncio.wait_for(call, self.limits.call_timeout_s)
        except TimeoutError:
            raise ServiceError(TIMED_OUT, f"environment call timed out after {self.limits.call_timeout_s:g}s") from None

    async def _reset(self, body: dict[str, Any]) -> dict[str, Any]:
        episode = _text(body, "episode")
        raw = body.get("item")
        if not isinstance(raw, dict):
            raise ServiceError(BAD_REQUEST, "bad request: `item` is not an object")
        try:
            item = EnvItem(**raw)
        except TypeError as err:
            raise ServiceError(BAD_REQUEST, f"bad request: item: {one_line(err)}") from None
        self._drop(episode)  # a replay of an episode this instance held: start it over
        self._evict(time.monotonic() - self.limits.idle_ttl_s)
        if len(self.episodes) + self._opening >= self.limits.max_episodes:
            raise ServiceError(FULL, f"instance {self.instance} is full ({self.limits.max_episodes} episodes)")
        self._opening += 1
        try:
            env, observation = await self._call(self._open, item)
        finally:
            self._opening -= 1
        self.episodes[episode] = _Episode(env, time.monotonic())
        self.counts["episodes"] += 1
        deterministic = bool(getattr(env, "deterministic", False))
        return {"instance": self.instance, "observation": observation, "deterministic": deterministic}

    def _open(self, item: EnvItem) -> tuple[Environment, str]:
        env = make_env(self.spec, self.options)
        observation = env.reset(item)
        if not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not str")
        return env, observation

    async def _step(self, body: dict[str, Any]) -> dict[str, Any]:
        episode, action = _text(body, "episode"), _text(body, "action", empty=True)
        held = self._held(episode)
        async with held.lock:
            if self.episodes.get(episode) is not held:  # closed or failed while this step waited its turn
                raise ServiceError(UNKNOWN_EPISODE, "unknown episode")
            try:
                result = await self._call(held.env.step, action)
                if not isinstance(result, StepResult):
                    raise TypeError(f"step returned {type(result).__name__}, not StepResult")
            except BaseException:
                self._drop(episode)  # its state is unknown now: the episode ends here
                raise
            held.used_at = time.monotonic()
        self.counts["steps"] += 1
        if result.done:
            self._drop(episode)
        return {"observation": result.observation, "reward": result.reward, "done": result.done, "info": result.info}

    async def _close(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"closed": self._drop(_text(body, "episode"))}

    def _drop(self, episode: str) -> bool:
        """Forget an episode and close its environment (an environment with a `close()`, e.g. the python tool's
        sandbox, releases what it holds); whether it was held."""
        held = self.episodes.pop(episode, None)
        if held is None:
            return False
        close = getattr(held.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as err:  # tolerated: the episode is over either way
                log.warning("env_close_failed", instance=self.instance, episode=episode, error=one_line(err))
        return True

    def _held(self, episode: str) -> _Episode:
        held = self.episodes.get(episode)
        if held is None:
            raise ServiceError(UNKNOWN_EPISODE, "unknown episode")
        return held

    # ------------------------------------------------------------ idle episodes

    def _evict(self, before: float) -> None:
        """Drop the episodes idle since `before` (`time.monotonic()`), other than those in a call now."""
        stale = [e for e, held in self.episodes.items() if held.used_at < before and not held.lock.locked()]
        for episode in stale:
            self._drop(episode)
        if stale:
            self.counts["evicted"] += len(stale)
            log.info("env_episodes_evicted", instance=self.instance, episodes=len(stale))

    async def _evict_idle(self) -> None:
        every = max(0.05, min(self.limits.idle_ttl_s / 4, 5.0))
        while True:
            await asyncio.sleep(every)
            self._evict(time.monotonic() - self.limits.idle_ttl_s)


def _text(body: dict[str, Any], key: str, *, empty: bool = False) -> str:
    value = body.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise ServiceError(BAD_REQUEST, f"bad request: `{key}` is not a {'' if empty else 'non-empty '}string")
    return value


def subjects_of(topology_or_run: Topology | str) -> EnvSubjects:
    """The environment subjects of a run given by its topology or its name."""
    return topology_or_run.env if isinstance(topology_or_run, Topology) else env_subjects(topology_or_run)


async def serve_env(
    nc: NATS,
    topology_or_run: Topology | str,
    spec: str,
    options: dict[str, Any] | None = None,
    *,
    limits: ServerLimits | None = None,
    instance: str | None = None,
) -> EnvServer:
    """Serve the environment `spec` (a built-in or `module:Class`, made with `options`) for the run on `nc`; the
    server answers until its `stop()`. ValueError when the class or its options are wrong."""
    return await EnvServer(nc, subjects_of(topology_or_run), spec, options, limits, instance).start()

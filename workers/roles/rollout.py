"""The rollout role: generates the n responses of each prompt group with the current policy.

Prompt groups fetched by the worker loop are collected into one engine call (up to
`rollout.batch_groups` groups). Before every call the worker loads the newest published weights, and
it never generates with weights older than `trainer version - max_staleness` (it waits for them).
Each group is stamped with the version of the weights that generated it (with `rollout.partial`, its oldest
token's version; every token's version travels in `Sample.version_spans`, see `workers.roles.partial`). A
prompt that can never be generated (a media reference that points nowhere, text the tokenizer refuses, more tokens
than the model's context) is dead-lettered on its own with the reason, before it could fail a whole batch; a
`rollout.max_new_tokens` that fills the model's context by itself is refused at start. With an `eval` section, the
worker evaluates the held-out set between two engine calls when a block of `eval.every` versions is due
(`workers.roles.evaluation`). It announces its start-up stages on the run's events (`workers.roles.stages`).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import urlparse

from relax_bus.bus import Bus
from relax_bus.control import Reject, Retry
from relax_bus.errors import BlobNotFound, ConfigError
from relax_bus.log import get_logger
from relax_bus.policy_version import VersionTracker
from relax_bus.staleness import sync_floor
from relax_bus.worker import Delivery, Worker, WorkerOptions
from schemas import PromptGroup, RolloutGroup, RolloutTimings, Sample, WireTensor
from schemas.parts import MediaPart
from workers.data.jsonl_task import media_file, task_media_root
from workers.data.models import load_tokenizer, materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import prompt_text
from workers.engines.base import Engine, Generated, MediaEngine, MediaInputs, SamplingSettings, make_engine
from workers.envs.formats import prompt_tools
from workers.omni.errors import MediaError
from workers.omni.loading import is_multimodal
from workers.omni.logprobs import check_positions
from workers.omni.media_refs import PayloadCache, has_media, uri_path
from workers.omni.prompts import MediaPrompter
from workers.roles.partial import generate_partial, labelled
from workers.roles.serve import RoleContext, run_worker
from workers.roles.stages import announce_stage
from workers.weights import WeightTransport, make_transport

if TYPE_CHECKING:
    from workers.roles.agent import Agent
    from workers.roles.evaluation import Evaluator

log = get_logger(__name__)
COLLECT_S = 0.01


@dataclass
class _Request:
    prompt: PromptGroup
    ids: list[int]
    """Prompt token ids, as `workers.data.prompts` renders them."""
    received: float
    media: MediaInputs | None = None
    """The processor's tensors of a prompt with media (its `input_ids` are `ids`), for a multimodal engine."""
    done: asyncio.Future[RolloutGroup] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Rollout:
    """Engine, tokenizer, weights and the micro-batcher of one rollout worker."""

    def __init__(self, bus: Bus, engine: Engine, tokenizer: object, transport: WeightTransport, worker_id: str):
        self.bus = bus
        self.engine = engine
        self.tokenizer = tokenizer
        self.transport = transport
        self.worker_id = worker_id
        self.tracker = VersionTracker(bus.version)
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()
        cfg = bus.config.rollout
        self.sampling = SamplingSettings(
            temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens
        )
        self.batch = cfg.batch_groups
        self._tokenizing = threading.Lock()  # handlers tokenise in threads; one tokenizer object serves them all
        self.tools = prompt_tools(bus.config.agent)
        """The tool descriptions prompts render with (a `hermes` agent's environment's; None: none)."""
        processor = getattr(engine, "processor", None)
        self.media_root = task_media_root(bus.config.task)
        """The one directory `file://` media references are read from (the jsonl task's); None: none is."""
        self.prompter = None if processor is None else MediaPrompter(processor, media_root=self.media_root)
        """Turns media prompts into processor tensors (a multimodal engine only; a text model reads the text parts)."""
        self.payloads = PayloadCache(bus.media, root=self.media_root)
        self._loop_task: asyncio.Task[None] | None = None
        self._announced = False
        """Whether this worker has announced its first engine call (`workers.roles.stages`)."""
        self.worker: Worker[PromptGroup] | None = None
        self.agent: Agent | None = None
        """Runs each sample as a multi-turn episode (`agent` in the run config); None: one response per sample."""
        self.evaluator: Evaluator | None = None
        """Evaluates the held-out set between engine calls (`eval` in the run config); None: no evaluation."""

    async def start(self) -> None:
        await self.tracker.start()
        self._loop_task = asyncio.create_task(self._batches(), name="rollout-batches")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self.tracker.stop()
        if self.evaluator is not None:
            self.evaluator.close()

    async def handle(self, prompt: PromptGroup, delivery: Delivery) -> RolloutGroup:
        """Worker handler: check and tokenise the group, queue it for the next engine call, wait for its samples."""
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError("rollout batch loop stopped") from self._loop_task.exception()
        await self._check_media(prompt)
        media = None
        if self.prompter is not None and has_media(prompt.parts):
            media = await self._media_inputs(prompt)
            ids = media["input_ids"][0].tolist()
            self._check_room(ids)
        else:
            ids = await asyncio.to_thread(self._encode, prompt)  # a long text takes a while: off the event loop
        request = _Request(prompt, ids, time.time(), media)
        await self.queue.put(request)
        return await request.done

    async def sync_weights(self) -> float:
        """Load the newest weights (waiting for the first version); return seconds spent."""
        started = time.perf_counter()
        await self.tracker.refresh()  # one KV read per engine call: never generate on a watcher's late news
        floor = sync_floor(max(self.tracker.value, 0), self.bus.config.staleness.max_staleness)
        target = await self.tracker.wait_for(max(floor, 0))
        if target <= self.engine.version:
            return 0.0
        try:
            state = await self.transport.read(target)
        except BlobNotFound as err:
            raise Retry(1.0, f"weights v{target} not found: {err}") from None
        await asyncio.to_thread(self.engine.load_state_dict, state, target)
        if self.worker is not None:
            self.worker.policy_version = target
        log.info("weights_loaded", version=target, seconds=round(time.perf_counter() - started, 3))
        await self._expect_next(target)
        return time.perf_counter() - started

    async def _expect_next(self, loaded: int) -> None:
        """Tell the transport which version this worker will load next: every engine call loads the newest one
        (`sync_weights`), so while calls come faster than versions, that is the next one published."""
        try:
            await self.transport.expect(loaded + 1)
        except Exception as err:  # tolerated: a hint; that version is then fetched once announced, as usual
            log.warning("weights_expect_failed", version=loaded + 1, error=f"{type(err).__name__}: {err}")

    async def _batches(self) -> None:
        while True:
            requests = [await self.queue.get()]
            await asyncio.sleep(COLLECT_S)  # let the rest of a fetched batch arrive
            while len(requests) < self.batch and not self.queue.empty():
                requests.append(self.queue.get_nowait())
            try:
                results = await self._generate(requests)
            except Exception as err:  # each waiting handler gets the failure; the worker loop settles it
                for r in requests:
                    if not r.done.done():
                        r.done.set_exception(err)
                continue
            for r, group in zip(requests, results, strict=True):
                if not r.done.done():  # a handler cancelled by shutdown no longer waits
                    r.done.set_result(group)
            if self.evaluator is not None:  # between batches: the groups above are on their way already
                await self._evaluate()

    async def _evaluate(self) -> None:
        """The held-out evaluation, if one is due. A failure is logged and generation goes on (deliberate: the
        evaluation is a report, never a reason to stop training; its block is then not evaluated)."""
        assert self.evaluator is not None
        try:
            await self.evaluator.after_batch()
        except Exception as err:  # tolerated: see the docstring
            log.warning("eval_failed", version=self.engine.version, error=f"{type(err).__name__}: {err}")

    async def _generate(self, requests: list[_Request]) -> list[RolloutGroup]:
        sync_s = await self.sync_weights()
        version = self.engine.version
        if not self._announced:  # the first engine call (compiling, caches) can take a while of its own
            self._announced = True
            await announce_stage(self.bus, "rollout", "generating the first groups", version=version)
        ids = [r.ids for r in requests]
        n = self.bus.config.samples_per_group
        cfg = self.bus.config.rollout
        seeds = None if cfg.seed is None else [group_seed(cfg.seed, r.prompt) for r in requests]
        started = time.perf_counter()
        media = [r.media for r in requests]
        if self.agent is not None:  # multi-turn episodes (media and partial rollouts are refused at start)
            groups = await self.agent.groups([r.prompt for r in requests], ids, n, seeds, version)
        elif any(m is not None for m in media):  # partial rollouts are refused for multimodal models at start
            engine = cast(MediaEngine, self.engine)
            outputs = await asyncio.to_thread(engine.generate, ids, n, self.sampling, seeds, media)
            groups = [(version, tuple(sample_of(g) for g in samples)) for samples in outputs]
        elif cfg.partial == "off":
            outputs = await asyncio.to_thread(self.engine.generate, ids, n, self.sampling, seeds)
            groups = [(version, tuple(sample_of(g) for g in samples)) for samples in outputs]
        else:
            chunked = await generate_partial(
                self.engine, ids, n, self.sampling, seeds, cfg.partial_chunk, cfg.partial, self._refresh
            )
            groups = []
            for samples in chunked:
                oldest, spans = labelled(samples)
                groups.append((oldest, tuple(sample_of(p.generated, s) for p, s in zip(samples, spans, strict=True))))
        elapsed = time.perf_counter() - started
        return [
            RolloutGroup(
                prompt=r.prompt,
                prompt_token_ids=WireTensor.from_values(prompt_ids, "int32"),
                samples=samples,
                policy_version=group_version,
                engine=self.engine.name,
                worker_id=self.worker_id,
                timings=RolloutTimings(
                    queued_s=max(0.0, time.time() - r.received - elapsed), generate_s=elapsed, weight_sync_s=sync_s
                ),
            )
            for r, prompt_ids, (group_version, samples) in zip(requests, ids, groups, strict=True)
        ]

    async def _refresh(self) -> bool:
        """Between two chunks of a partial rollout: load the newest weights if there are newer ones; say whether.
        A failed fetch or load is logged and the rows go on under the weights they have (deliberate: the version
        that failed never labels a token, and the next chunk tries again)."""
        held = self.engine.version
        try:
            await self.sync_weights()
        except Exception as err:  # tolerated: see the docstring
            log.warning("partial_weights_not_loaded", held=held, error=f"{type(err).__name__}: {err}")
            return False
        return self.engine.version > held

    def _encode(self, prompt: PromptGroup) -> list[int]:
        """Prompt token ids (`workers.data.prompts`); Reject when the text cannot be tokenised or leaves no room."""
        model = self.bus.config.model
        text = prompt_text(prompt.parts)
        try:
            with self._tokenizing:
                ids = prompt_ids(
                    self.tokenizer, text, model.prompt_format, model.system_prompt, prompt.history, self.tools
                )
        except (ValueError, TypeError) as err:  # deliberate: input the tokenizer refuses is bad input, not a fault
            raise Reject(f"prompt text cannot be tokenised: {type(err).__name__}: {err}") from None
        self._check_room(ids)
        return ids

    def _check_room(self, ids: list[int]) -> None:
        """Reject a prompt that leaves no room for the response in the model's context."""
        limit, room = self.engine.max_context, self.sampling.max_new_tokens
        if limit is not None and len(ids) + room > limit:
            raise Reject(
                f"prompt of {len(ids)} tokens leaves no room for rollout.max_new_tokens={room} "
                f"in the model's context of {limit} tokens"
            )

    async def _media_inputs(self, prompt: PromptGroup) -> MediaInputs:
        """The processor's tensors of a media prompt; Reject (dead-letter) media that cannot be read or decoded."""
        assert self.prompter is not None
        prompter = self.prompter
        try:
            payloads = await self.payloads.payloads(prompt.parts)

            def run() -> MediaInputs:
                with self._tokenizing:
                    return prompter.inputs(prompt.parts, payloads)

            return await asyncio.to_thread(run)
        except MediaError as err:
            raise Reject(f"prompt media cannot be used: {err}") from None

    async def _check_media(self, prompt: PromptGroup) -> None:
        """Reject a prompt whose media reference names no object in the run's media store (or no regular file inside
        the run's media root)."""
        for i, part in enumerate(prompt.parts):
            ref = part.ref if isinstance(part, MediaPart) else None
            if ref is None or ref in self.payloads:  # read already: it exists (the store lookup is a round trip)
                continue
            where = f"prompt part {i} ({part.type})"
            media = self.bus.media
            if ref.digest is not None and await media.info(ref.digest.removeprefix("sha256:")) is None:
                raise Reject(f"{where} references {ref.digest}, which is not in the media store {media.bucket}")
            if ref.uri is not None and urlparse(ref.uri).scheme in ("file", ""):
                try:
                    media_file(uri_path(ref.uri), self.media_root)
                except ValueError as err:
                    raise Reject(f"{where} references {ref.uri}, which this worker does not read: {err}") from None


def group_seed(base: int, prompt: PromptGroup) -> int:
    """The sampling seed of one group: a hash of `base`, the run, the group id and its attempt (31 bits).

    A requeued group (a new attempt) samples afresh; a redelivered one regenerates the same samples.
    """
    key = f"{base}/{prompt.run}/{prompt.group_id}/{prompt.attempt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % (1 << 31)


def sample_of(g: Generated, spans: tuple[tuple[int, int], ...] = ()) -> Sample:
    """A generated completion as a wire Sample (with its routed experts when the engine recorded them, and the
    version spans of a partial rollout: empty when every token is of the group's version)."""
    routed = None
    if g.routing is not None:
        dtype = "uint8" if g.routing.itemsize == 1 else "int16"
        routed = WireTensor(dtype=dtype, shape=tuple(g.routing.shape), data=g.routing.tobytes())
    return Sample(
        token_ids=WireTensor.from_values(g.token_ids, "int32"),
        logprobs=WireTensor.from_values(g.logprobs, "float32"),
        text=g.text,
        finish_reason=g.finish_reason,
        routed_experts=routed,
        version_spans=spans,
    )


async def serve(ctx: RoleContext) -> None:
    """`relax worker rollout`: build the engine, then run the worker loop over it."""
    bus = ctx.connected
    await announce_stage(bus, "rollout", "loading model", engine=bus.config.rollout.engine.type)
    try:
        worker, rollout = await rollout_worker(bus, ctx.cache)
    except ValueError as err:  # a model or engine the config names cannot be used here
        raise ConfigError(f"run {ctx.run} (rollout)", [str(err)]) from None
    await announce_stage(bus, "rollout", "model loaded, waiting for v0 and the first prompts")
    await rollout.start()
    await run_worker(ctx, worker, rollout.stop)


def engine_device(kind: str) -> str:
    """`rollout.device` as a device string: `auto` is cuda when torch sees a GPU, else cpu."""
    import torch

    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("rollout.device", ["'cuda' asked for, but torch sees no CUDA device"])
    return "cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu"


async def rollout_worker(
    bus: Bus, cache_dir: Path, options: WorkerOptions | None = None
) -> tuple[Worker[PromptGroup], Rollout]:
    """Build the engine from the run config and a Worker that feeds it."""
    cfg = bus.config
    model_dir = await asyncio.to_thread(materialize, cfg.model.source, cache_dir / "base", cfg.model.seed)
    engine_cfg = cfg.rollout.engine
    device = engine_device(cfg.rollout.device)
    record = cfg.trainer.moe.routing_replay == "r3"  # the experts of every token travel with the samples (docs/r3.md)
    # A LoRA run's versions are adapters: the engine (torch or vllm, the config admits no other) serves them.
    lora = {} if cfg.trainer.lora is None else {"lora": cfg.trainer.lora}
    engine = await asyncio.to_thread(
        lambda: make_engine(
            engine_cfg.type, model_dir, device=device, record_routing=record, **engine_cfg.options(), **lora
        )
    )
    engine.version = -1  # nothing loaded from the trainer yet: the first batch waits for v0
    if engine.max_context is not None and cfg.rollout.max_new_tokens >= engine.max_context:
        raise ConfigError(
            "rollout.max_new_tokens",
            [
                f"{cfg.rollout.max_new_tokens} new tokens leave no room for a prompt in the model's context of "
                f"{engine.max_context} tokens"
            ],
        )
    if getattr(engine, "processor", None) is not None:
        check_positions(engine.model)  # UnsupportedModelError is a ValueError: refused at start
        if cfg.rollout.partial != "off":
            raise ValueError("rollout.partial needs a text model: a multimodal prompt cannot be continued yet")
    elif is_multimodal(model_dir):
        raise ValueError(f"a multimodal model needs an engine that takes media (torch), not {engine_cfg.type}")
    options = options or WorkerOptions(concurrency=cfg.rollout.batch_groups)
    rollout = Rollout(bus, engine, load_tokenizer(model_dir), make_transport(bus), options.worker_id)
    if cfg.agent is not None:
        from workers.roles.agent import Agent  # the environment client and the episodes: only runs with them

        if getattr(engine, "processor", None) is not None:
            raise ValueError("agent episodes need a text model: a multimodal prompt cannot be continued yet")
        rollout.agent = await Agent.start(bus, engine, rollout.tokenizer, rollout.sampling)
    if cfg.eval is not None:
        from workers.roles.evaluation import Evaluator  # the scorer and the held-out set: only runs with eval

        rollout.evaluator = await asyncio.to_thread(Evaluator, bus, engine, rollout.tokenizer, options.worker_id)
    worker = Worker(bus, "rollout", rollout.handle, PromptGroup, options)
    rollout.worker = worker
    return worker, rollout

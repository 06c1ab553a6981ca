"""Every message that crosses the bus, as frozen pydantic models.

One message carries one GRPO group. Each stage wraps the previous stage's message, so a
downstream role never has to join against anything:

    PromptGroup -> RolloutGroup(prompt) -> ScoredGroup(rollout) -> TrainGroup(scored)

`schema_version` is `MAJOR.MINOR`; a decoder accepts any minor of a major it knows and refuses
other majors (see `schemas.codec`). Adding an optional field is a minor bump; anything else is
a major bump.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from schemas.bounded import (
    MAX_FIELDS,
    MAX_SAMPLE_TEXT,
    MAX_STEP_SAMPLES,
    Count,
    FieldValue,
    Name,
    Value,
    check_counters,
)
from schemas.episode import EpisodeInfo
from schemas.parts import Part
from schemas.scoring import Judgement, RewardDetail
from schemas.tensor import WireTensor

SCHEMA_VERSION = "1.10"  # 1.1: PromptGroup.history; 1.2: Sample.routed_experts; 1.3: Sample.version_spans;
# 1.4: Sample.loss_mask and Sample.episode, ChatTurn role "tool"; 1.5: TrainGroup.teacher_logprobs;
# 1.6: Metric.samples; 1.7: RolloutGroup.judgements, RewardDetail.checks; 1.8: PromptGroup.columns;
# 1.9: TrainGroup.critic; 1.10: StepSample.verdict, checks and judge_prompt
SCHEMA_MAJOR = 1

_ID = r"^[A-Za-z0-9_.:-]{1,200}$"
Scalar = str | int | float | bool | None


class Message(BaseModel):
    """Base of every bus message.

    Every message type says how the server deduplicates it: it defines `publish_id` (the deterministic
    `Nats-Msg-Id` of a publish), or it sets `deduplicated = False` (every publish is stored). A type that
    does neither is refused when it is defined, so a new type cannot go without deduplication unnoticed.
    """

    # extra="ignore": a newer minor version may add fields an older reader does not know.
    model_config = ConfigDict(frozen=True, extra="ignore")

    deduplicated: ClassVar[bool] = True
    """False for a type whose publishes carry no id: the server stores every copy."""

    schema_version: str = Field(default=SCHEMA_VERSION, pattern=r"^\d+\.\d+$")
    """`MAJOR.MINOR` of the schema the producer wrote."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.deduplicated and cls.publish_id is Message.publish_id:
            raise TypeError(
                f"message type {cls.__name__} defines no publish_id(): define one (the server deduplicates a "
                "republish by it) or set `deduplicated = False`"
            )

    def publish_id(self) -> str | None:
        """The deterministic publish id (`Nats-Msg-Id`) of this message; None when it carries none."""
        return None


class ChatTurn(BaseModel):
    """One earlier turn of a conversation: who spoke, and the text."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class PromptGroup(Message):
    """A prompt to sample `n_samples` responses for: the unit of work of one GRPO group."""

    kind: Literal["prompt_group"] = "prompt_group"
    run: str = Field(pattern=_ID)
    """Run the group belongs to."""
    group_id: str = Field(pattern=_ID)
    """Stable id of the group across attempts (dataset position based)."""
    parts: tuple[Part, ...] = Field(min_length=1)
    """The prompt: text and media parts in order (the user's latest turn in a conversation)."""
    history: tuple[ChatTurn, ...] = ()
    """Earlier turns of the conversation, rendered before `parts` by the chat template; empty for one turn."""
    answer: str | None = None
    """Reference answer for verifiable rewards, if the task has one."""
    n_samples: int = Field(ge=1, le=4096)
    """Responses wanted for this group."""
    attempt: int = Field(default=0, ge=0)
    """0 for the first release; +1 each time the group is requeued as stale."""
    release_index: int = Field(ge=0)
    """Position of this release in the feeder's release sequence (credit accounting)."""
    released_at_version: int = Field(ge=0)
    """Trainer policy version when the feeder released it."""
    epoch: int = Field(default=0, ge=0)
    """Pass over the dataset this group comes from."""
    index: int = Field(default=0, ge=0)
    """Row of the dataset this group comes from."""
    task: str | None = None
    """Task name, used to pick the reward function."""
    metadata: dict[str, Scalar] = Field(default_factory=dict)
    """Free-form scalars carried along to the trainer's records."""
    columns: dict[str, Scalar] = Field(default_factory=dict)
    """The dataset row's other columns (an `hf` task's), handed to the rewards that take them."""

    @property
    def prompt(self) -> PromptGroup:
        """The prompt group itself (every stage of a group exposes the prompt it carries)."""
        return self

    def publish_id(self) -> str:
        """`<run>/<group>/prompt/<attempt>`."""
        return f"{self.run}/{self.group_id}/prompt/{self.attempt}"


class Sample(BaseModel):
    """One sampled response of a group, or one episode of turns (policy tokens and observation tokens)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    token_ids: WireTensor
    """Response token ids, int32/int64 `[tokens]`."""
    logprobs: WireTensor
    """Log-probability of each sampled token under the generating policy, float32 `[tokens]`."""
    text: str = ""
    """Decoded response text."""
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    """Why generation ended."""
    version_spans: tuple[tuple[int, int], ...] = ()
    """The policy version of every token, run-length: `((version, tokens), ...)` in token order, counts adding up
    to the response's length; empty when every token is of the group's version (`RolloutGroup.policy_version`)."""
    routed_experts: WireTensor | None = None
    """Experts each token the model was fed went to (R3), uint8 or int16 `[prompt + tokens - 1, moe layers, top_k]`:
    the prompt's tokens, then the response's but its last (never fed back); None when routing is not recorded."""
    loss_mask: WireTensor | None = None
    """An episode's trained tokens, uint8 `[tokens]`: 1 on the policy's own tokens, 0 on observation tokens appended
    by the rollout (never trained: out of the loss, the ratio, the KL and the entropy); None: every token is the
    policy's. An observation token's log-prob entry is 0 and means nothing."""
    episode: EpisodeInfo | None = None
    """How the episode went; None for a one-turn response."""

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        if self.token_ids.shape != self.logprobs.shape:
            raise ValueError(
                f"token_ids shape {self.token_ids.shape} differs from logprobs shape {self.logprobs.shape}"
            )
        if self.version_spans:
            if any(v < 0 or n < 1 for v, n in self.version_spans):
                raise ValueError(f"version_spans need versions >= 0 and counts >= 1: {self.version_spans}")
            covered = sum(n for _, n in self.version_spans)
            if covered != self.token_ids.numel:
                raise ValueError(f"version_spans cover {covered} tokens of a {self.token_ids.numel}-token response")
        if self.loss_mask is not None:
            if self.loss_mask.dtype != "uint8" or self.loss_mask.shape != self.token_ids.shape:
                raise ValueError(
                    f"loss_mask must be uint8 {self.token_ids.shape}, got {self.loss_mask.dtype} {self.loss_mask.shape}"
                )
            if any(v not in (0, 1) for v in self.loss_mask.to_values()):
                raise ValueError("loss_mask holds values other than 0 and 1")
        return self

    def trained(self) -> list[int]:
        """1 per token the trainer trains on, 0 per observation token (all 1 without a loss mask)."""
        if self.loss_mask is None:
            return [1] * self.token_ids.numel
        return [int(v) for v in self.loss_mask.to_values()]

    @property
    def oldest_version(self) -> int | None:
        """The oldest version among the response's tokens; None without spans."""
        return min(v for v, _ in self.version_spans) if self.version_spans else None


class RolloutTimings(BaseModel):
    """Where a rollout's wall time went."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    queued_s: float = Field(default=0.0, ge=0)
    """From release to the start of generation."""
    generate_s: float = Field(default=0.0, ge=0)
    """Generation itself."""
    weight_sync_s: float = Field(default=0.0, ge=0)
    """Weight loading that had to happen first."""


class RolloutGroup(Message):
    """The n sampled responses of a prompt group."""

    kind: Literal["rollout_group"] = "rollout_group"
    prompt: PromptGroup
    prompt_token_ids: WireTensor
    """Tokenised prompt, int `[tokens]`."""
    samples: tuple[Sample, ...] = Field(min_length=1)
    policy_version: int = Field(ge=0)
    """Version of the weights that generated the group (the oldest, if an update happened mid-way)."""
    engine: str = "torch"
    """Generation engine that produced it."""
    worker_id: str = ""
    """Rollout worker that produced it."""
    timings: RolloutTimings = Field(default_factory=RolloutTimings)
    judgements: tuple[Judgement, ...] | None = None
    """The judge's verdict on each sample, in a run with a `judge` section (set by the `genrm` role)."""

    @property
    def group_id(self) -> str:
        return self.prompt.group_id

    @model_validator(mode="after")
    def _one_judgement_per_sample(self) -> RolloutGroup:
        if self.judgements is not None and len(self.judgements) != len(self.samples):
            raise ValueError(f"{len(self.judgements)} judgements for {len(self.samples)} samples")
        return self

    def publish_id(self) -> str:
        """`<run>/<group>/rollout/<attempt>`."""
        return _stage_id(self.prompt, "rollout")

    @property
    def newest_version(self) -> int:
        """The newest version among the samples' tokens (the group's version when no sample has spans)."""
        return max((v for s in self.samples for v, _ in s.version_spans), default=self.policy_version)

    @model_validator(mode="after")
    def _oldest_version_decides(self) -> RolloutGroup:
        oldest = [v for s in self.samples if (v := s.oldest_version) is not None]
        if oldest and min(oldest) != self.policy_version:
            raise ValueError(
                f"policy_version {self.policy_version} is not the oldest version among the samples' tokens "
                f"({min(oldest)}): the staleness rule judges a group by its oldest token"
            )
        return self

    @model_validator(mode="after")
    def _routing_fits(self) -> RolloutGroup:
        prompt = self.prompt_token_ids.numel
        for i, s in enumerate(self.samples):
            r = s.routed_experts
            if r is None:
                continue
            if r.dtype not in ("uint8", "int16") or len(r.shape) != 3:
                raise ValueError(
                    f"sample {i}: routed_experts must be uint8/int16 [tokens, layers, top_k], got {r.dtype} {r.shape}"
                )
            if r.shape[0] != prompt + s.token_ids.numel - 1:
                raise ValueError(
                    f"sample {i}: routed_experts covers {r.shape[0]} tokens; prompt {prompt} + response "
                    f"{s.token_ids.numel} - 1 = {prompt + s.token_ids.numel - 1} were fed to the model"
                )
        return self


class ScoredGroup(Message):
    """A rollout group with a reward for every sample."""

    kind: Literal["scored_group"] = "scored_group"
    rollout: RolloutGroup
    rewards: tuple[float, ...]
    details: tuple[RewardDetail, ...] = ()
    """One entry per sample, or empty."""
    worker_id: str = ""
    """Reward worker that scored it."""

    @property
    def prompt(self) -> PromptGroup:
        return self.rollout.prompt

    @property
    def group_id(self) -> str:
        return self.prompt.group_id

    def publish_id(self) -> str:
        """`<run>/<group>/scored/<attempt>`."""
        return _stage_id(self.prompt, "scored")

    @model_validator(mode="after")
    def _one_per_sample(self) -> ScoredGroup:
        n = len(self.rollout.samples)
        if len(self.rewards) != n:
            raise ValueError(f"{len(self.rewards)} rewards for {n} samples")
        if self.details and len(self.details) != n:
            raise ValueError(f"{len(self.details)} reward details for {n} samples")
        return self


class CriticValues(BaseModel):
    """The critic's values of a group's sampled tokens (PPO with GAE), and how well it predicted this group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=0)
    """The critic's weights version that computed the values (value updates it had made before this group)."""
    values: tuple[WireTensor, ...]
    """V(s_t) per sample (`[tokens]` each): the value of the state before each sampled token."""
    value_loss: float
    """The clipped value loss of the critic's first update on this group (its error before training on it)."""
    value_mean: float
    """Mean of the values over the group's response tokens."""
    explained_variance: float
    """1 - Var(R - V) / Var(R) over the group's response tokens, R the GAE returns (0 when Var(R) is 0)."""


class TrainGroup(Message):
    """What the trainer consumes: a scored group plus optional upstream extras."""

    kind: Literal["train_group"] = "train_group"
    scored: ScoredGroup
    ref_logprobs: tuple[WireTensor, ...] | None = None
    """Reference-model log-probs per sample (`[tokens]` each), when a KL term is on."""
    teacher_logprobs: tuple[WireTensor, ...] | None = None
    """The teacher's log-probs of every sampled token per sample (`[tokens]` each), in a run with a teacher
    (on-policy distillation)."""
    critic: CriticValues | None = None
    """The critic's per-token values, in a run with a critic (PPO with GAE)."""

    @model_validator(mode="after")
    def _one_per_sample(self) -> TrainGroup:
        n = len(self.scored.rollout.samples)
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"{len(self.ref_logprobs)} reference log-prob tensors for {n} samples")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"{len(self.teacher_logprobs)} teacher log-prob tensors for {n} samples")
        if self.critic is not None and len(self.critic.values) != n:
            raise ValueError(f"{len(self.critic.values)} critic value tensors for {n} samples")
        return self

    @property
    def prompt(self) -> PromptGroup:
        return self.scored.prompt

    @property
    def group_id(self) -> str:
        return self.scored.group_id

    @property
    def policy_version(self) -> int:
        return self.scored.rollout.policy_version

    def publish_id(self) -> str:
        """`<run>/<group>/train/<attempt>`."""
        return _stage_id(self.prompt, "train")


def _stage_id(prompt: PromptGroup, stage: str) -> str:
    """The publish id of a group at `stage`: run, group and attempt of the prompt it carries."""
    return f"{prompt.run}/{prompt.group_id}/{stage}/{prompt.attempt}"


GroupMessage: TypeAlias = PromptGroup | RolloutGroup | ScoredGroup | TrainGroup
"""A message about one GRPO group, at any stage: each has `.prompt` and `.group_id`."""
GROUP_MESSAGES: tuple[type[PromptGroup], type[RolloutGroup], type[ScoredGroup], type[TrainGroup]] = (
    PromptGroup,
    RolloutGroup,
    ScoredGroup,
    TrainGroup,
)
"""The group message types, for `isinstance`."""


class WeightsAnnouncement(Message):
    """The trainer published the weights of `version`."""

    kind: Literal["weights"] = "weights"
    run: str = Field(pattern=_ID)
    version: int = Field(ge=0)
    """Policy version: number of optimizer updates behind these weights."""
    transport: str = "object_store"
    """Weight transport that holds them (object_store, filesystem, nccl)."""
    location: str
    """Transport-specific address: object name, path, or group name."""
    format: Literal["safetensors", "torch"] = "safetensors"
    size: int = Field(ge=0)
    """Bytes."""
    digest: str | None = None
    """`sha256:<hex>` of the serialized weights, when known."""
    step: int = Field(default=0, ge=0)
    """Trainer step that produced them."""
    created_at: float = Field(default_factory=time.time)

    def publish_id(self) -> str:
        """`<run>/weights/<version>`."""
        return f"{self.run}/weights/{self.version}"


class WorkerHeartbeat(Message):
    """A worker's own liveness record, rewritten every few seconds into a TTL bucket."""

    kind: Literal["heartbeat"] = "heartbeat"
    deduplicated: ClassVar[bool] = False  # a KV value, rewritten in place
    run: str = Field(pattern=_ID)
    role: str
    worker_id: str
    pid: int
    host: str
    policy_version: int | None = None
    """Weights version the worker holds, for roles that hold weights."""
    counters: dict[str, int] = Field(default_factory=dict)
    """Processed, retried, dropped, dead-lettered, failed, ..."""
    started_at: float
    at: float = Field(default_factory=time.time)


class RunEvent(Message):
    """Something that happened in a run, for people and dashboards."""

    kind: Literal["event"] = "event"
    deduplicated: ClassVar[bool] = False  # each event is news of its own
    run: str = Field(pattern=_ID)
    event: Name
    """Event name, e.g. group_dropped, worker_started."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    source: str = Field(default="", max_length=200)
    """Role or worker id that emitted it."""
    fields: dict[Name, FieldValue] = Field(default_factory=dict, max_length=MAX_FIELDS)
    """What happened, as named scalars (bounded: `schemas.bounded`)."""
    at: float = Field(default_factory=time.time, allow_inf_nan=False)


SampleText = Annotated[str, Field(max_length=MAX_SAMPLE_TEXT)]
"""A logged sample's prompt, response or error: clipped by the producer (`metrics.sample_text_bytes`)."""


class StepSample(BaseModel):
    """One trained sample as the run's samples log shows it (`Metric.samples`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    group_id: str = Field(pattern=_ID)
    """The group it answers."""
    index: int = Field(ge=0, le=4096)
    """Its position in the group."""
    policy_version: Count
    """The policy version that generated the group (its oldest, when an update happened mid-way)."""
    prompt: SampleText
    """The prompt's text (earlier turns first, a media part as `<image>`, `<audio>`, `<video>`), clipped at its head."""
    response: SampleText
    """The response's text as the reward role scored it (decoded from its token ids), clipped at its tail."""
    reward: Value
    """Its reward (before the trainer's shaping); 0 when the reward failed."""
    terms: dict[Name, Value] = Field(default_factory=dict, max_length=MAX_FIELDS)
    """The reward's weighted terms (they sum to the reward), by name."""
    error: SampleText | None = None
    """Why the reward failed (the sample was then left out of the update); None when it did not."""
    finish_reason: Literal["stop", "length", "abort"] = "stop"
    """Why generation ended."""
    tokens: Count = 0
    """Response tokens (an episode's: every turn's, observations included)."""
    verdict: Value | None = None
    """The judge's score of it (a run with a `judge` section); None without a judge, or when it gave none."""
    checks: dict[Name, Value] = Field(default_factory=dict, max_length=MAX_FIELDS)
    """The rules logged beside the judge (`judge.check`), never part of the reward, by name."""
    judge_prompt: SampleText | None = None
    """The judge's prompt: its template filled with the prompt, the response and the prompt's answer, clipped at its
    head; None without a judge."""


class Metric(Message):
    """Scalar metrics of one training step, and a few of its samples for the samples log."""

    kind: Literal["metric"] = "metric"
    deduplicated: ClassVar[bool] = False  # each record is stored as published
    run: str = Field(pattern=_ID)
    step: Count
    values: Annotated[dict[Name, Value], Field(max_length=MAX_FIELDS), AfterValidator(check_counters)]
    """The step's values by name: finite or NaN; counts (step, version, `lag_<k>`, ...) whole and bounded."""
    at: float = Field(default_factory=time.time, allow_inf_nan=False)
    samples: tuple[StepSample, ...] = Field(default=(), max_length=MAX_STEP_SAMPLES)
    """A few of the step's trained samples (`metrics.samples_per_step`); empty when the log is off."""


class DeadLetter(Message):
    """A message the bus gave up on, kept with the reason."""

    kind: Literal["dead_letter"] = "dead_letter"
    run: str = Field(pattern=_ID)
    reason: str
    """Why it was dead-lettered, readable by a person."""
    source_subject: str
    """Subject the message was consumed from."""
    stream_seq: int | None = None
    """Sequence in the source stream."""
    deliveries: int = Field(default=1, ge=0)
    """How many times it had been delivered."""
    consumer: str = ""
    """Durable consumer that gave up on it."""
    headers: dict[str, str] = Field(default_factory=dict)
    payload: bytes = b""
    """The original payload."""
    at: float = Field(default_factory=time.time)

    def publish_id(self) -> str | None:
        """`<run>/dlq/<source subject>/<stream seq>`; None for a letter that names no sequence."""
        if self.stream_seq is None:
            return None
        return f"{self.run}/dlq/{self.source_subject}/{self.stream_seq}"


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.model_fields["kind"].default: m
    for m in (
        PromptGroup,
        RolloutGroup,
        ScoredGroup,
        TrainGroup,
        WeightsAnnouncement,
        WorkerHeartbeat,
        RunEvent,
        Metric,
        DeadLetter,
    )
}

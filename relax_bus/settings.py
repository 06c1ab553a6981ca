"""Settings: the NATS connection (from flags or RELAX_* environment variables) and the run config.

The run config is a YAML or JSON file given to `relax init`; it is validated here, stored in the
run's KV bucket, and read back by every worker, which therefore needs only `--nats-url` and `--run`.
Every validation problem is reported at once (`ConfigError.problems`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import TypeVar

from relax_bus.chain import Role, chain_problems, hop_keys
from relax_bus.errors import ConfigError

RUN_ID = r"^[A-Za-z0-9_-]{1,48}$"
HEADER_BYTES = 8 * 1024
"""Room for a message's headers that `bus.max_msg_bytes` must leave above the claim-check threshold."""
DEFAULT_HEADROOM = 64 * 1024
"""What the default `bus.max_msg_bytes` allows above the claim-check threshold (headers are a few hundred bytes)."""

if TYPE_CHECKING:
    ByteCount = int  # what every reader of such a field gets
else:
    ByteCount = Annotated[ByteSize, AfterValidator(int)]
"""A size in bytes: an int, or a string with a unit (`256MiB`, `2GiB`, `1.5 GB`; KiB/MiB/GiB are powers of 1024,
KB/MB/GB of 1000). Validated to a plain int, which is what every reader of the field gets."""


def _split_urls(value: Any) -> Any:
    if isinstance(value, str):
        return [u.strip() for u in value.split(",") if u.strip()]
    return value


def redacted(urls: str) -> str:
    """NATS URL(s) as they may be shown: the password of `user:pass@host` and a token (`token@host`) become `***`."""
    out = []
    for url in urls.split(","):
        parts = urlsplit(url.strip())
        if "@" in parts.netloc:
            host = parts.netloc.rsplit("@", 1)[1]
            who = f"{parts.username}:***" if parts.password is not None else "***"
            parts = parts._replace(netloc=f"{who}@{host}")
        out.append(urlunsplit(parts))
    return ",".join(out)


def has_secret(urls: str) -> bool:
    """Whether a NATS URL carries credentials (a password or a token): they must stay out of argv and logs."""
    return any("@" in urlsplit(u.strip()).netloc for u in urls.split(","))


class ConnectionSettings(BaseSettings):
    """How to reach NATS. Every field can be set as RELAX_<FIELD> in the environment."""

    model_config = SettingsConfigDict(env_prefix="RELAX_", extra="ignore", frozen=True)

    nats_url: Annotated[list[str], NoDecode, BeforeValidator(_split_urls)] = Field(
        default_factory=lambda: ["nats://127.0.0.1:4222"], min_length=1
    )
    """Server URL(s); several, comma-separated, for a cluster."""
    user: str | None = None
    """User name for user/password authentication."""
    password: str | None = None
    """Password for user/password authentication."""
    token: str | None = None
    """Token for token authentication."""
    creds_file: Path | None = None
    """NATS credentials file (`.creds`: a user JWT and its nkey seed) for decentralised authentication."""
    nkey_seed_file: Path | None = None
    """File holding an nkey user seed (`SU...`, `relax auth --nkeys` writes `<role>.nk`): the server checks a
    signature, so no secret crosses the network."""
    inbox_prefix: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")
    """Prefix of this client's reply subjects (default _INBOX); `relax auth` gives each user its own."""
    tls_ca_file: Path | None = None
    """CA bundle that signs the server's certificate (enables TLS)."""
    tls_cert_file: Path | None = None
    """Client certificate for mutual TLS."""
    tls_key_file: Path | None = None
    """Client key for mutual TLS."""
    connect_timeout_s: float = Field(default=3.0, gt=0)
    """How long the first connection may take before the command gives up."""
    connect_retry_s: float = Field(default=60.0, ge=0)
    """How long `relax worker` keeps retrying its first connection (a server that starts later); 0: one try."""
    nats_server_bin: Path | None = None
    """Explicit path of the nats-server binary used by `relax server` and the tests."""

    @model_validator(mode="after")
    def _tls_pairs(self) -> ConnectionSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        return self


class StalenessConfig(BaseModel):
    """How far rollouts may lag behind the trainer."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    max_staleness: int | None = Field(default=1, ge=0)
    """Largest allowed trainer version minus sample version; 0 is on-policy, null (or "unbounded") is
    fully asynchronous."""
    action: Literal["drop", "requeue"] = "drop"
    """What the trainer does with a stale group: drop it, or send its prompt back for fresh generation."""
    max_requeues: int = Field(default=2, ge=0)
    """How often one prompt group may be requeued before it is dropped."""
    mask_stale_tokens: bool = False
    """With partial rollouts (`rollout.partial`), judge a group by its newest token instead of its oldest, and
    leave its tokens older than `max_staleness` out of the loss instead of dropping the whole group."""

    @model_validator(mode="before")
    @classmethod
    def _unbounded(cls, data: Any) -> Any:
        if isinstance(data, dict) and str(data.get("max_staleness", "")).lower() in {
            "unbounded",
            "inf",
            "none",
        }:
            data = {**data, "max_staleness": None}
        return data


class BusConfig(BaseModel):
    """Limits of the run's streams, consumers and stores."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    storage: Literal["file", "memory"] = "file"
    """JetStream storage of every stream; file survives a server crash."""
    replicas: int = Field(default=1, ge=1, le=5)
    """Stream replicas (3 on a three-server cluster)."""
    hop_max_msgs: int = Field(default=10_000, ge=1)
    """Bound of each hand-off stream (prompts, rollouts, scored); a full hop pushes back on its producer."""
    hop_max_bytes: ByteCount = Field(default=256 << 20, ge=1 << 20)
    """Byte bound of each hand-off stream (JetStream reserves it on the server's disk)."""
    train_max_age_s: float = Field(default=7 * 86400, gt=0)
    """How long trained groups stay in the train stream for replay."""
    train_max_bytes: ByteCount = Field(default=2 << 30, ge=1 << 20)
    """Byte bound of the train stream, oldest first out (JetStream reserves it on the server's disk)."""
    ack_wait_s: float = Field(default=10.0, gt=0)
    """How long a delivered message may go unacknowledged before redelivery: a dead worker's messages come back at
    most this long after it died (benchmarks/redelivery.py); a live worker keeps each of its messages alive every
    ack_wait/4 however long its handler takes, riding out a stalled event loop of up to 3/4 of it."""
    max_deliver: int = Field(default=5, ge=1)
    """Deliveries of one message before it is dead-lettered."""
    max_ack_pending: int = Field(default=256, ge=1)
    """In-flight budget of each hop's consumer, shared by all workers of the role."""
    duplicate_window_s: float = Field(default=1800.0, gt=0)
    """Window in which a republished Nats-Msg-Id is recognised as a duplicate."""
    dlq_max_age_s: float = Field(default=14 * 86400, gt=0)
    """How long dead letters are kept."""
    dlq_max_bytes: ByteCount = Field(default=256 << 20, ge=1 << 20)
    """Byte bound of the dlq stream; at the bound the oldest letters go first, so dead-lettering never blocks a
    hop (JetStream reserves it on the server's disk)."""
    events_max_msgs: int = Field(default=100_000, ge=1)
    """Bound of the events stream (oldest go first)."""
    events_max_bytes: ByteCount = Field(default=256 << 20, ge=1 << 20)
    """Byte bound of the events stream, oldest first out (JetStream reserves it on the server's disk)."""
    claim_check_bytes: ByteCount = Field(default=512 * 1024, ge=1024)
    """Payloads above this size go to the object store; the message carries only their digest."""
    max_msg_bytes: ByteCount | None = Field(default=None, ge=1024)
    """Largest message (headers included) any stream of the run stores; the server refuses a bigger publish.
    Null: claim_check_bytes plus 64 KiB. At least claim_check_bytes plus 8 KiB, so that every message the claim
    check leaves inline fits."""
    media_max_bytes: ByteCount = Field(default=2 << 30, ge=1 << 20)
    """Byte bound of the media store (claim-check payloads and media items); a full store refuses new objects with
    an error naming this setting (JetStream reserves it on the server's disk)."""
    media_max_age_s: float = Field(default=7 * 86400, gt=0)
    """Age at which an object leaves the media store: the backstop for claim checks nobody deleted (a hop's
    claim is deleted when its consumer settles it). At least train_max_age_s: replay reads claim-checked train
    groups. Media items put by digest age out too (put them again for a longer run)."""
    weights_keep: int = Field(default=3, ge=1)
    """Policy versions kept in the weights store."""
    weights_max_bytes: ByteCount | None = Field(default=None, ge=1 << 20)
    """Byte bound of the weights store; null: none. Only the trainer may write this store, and its retention
    bounds it: v0 and the newest weights_keep versions (one more while the next is written) — ~2.7 GB for a
    135M-parameter float32 model at the defaults. A bound is reserved on the server's disk (JetStream), and a
    put that does not fit fails with an error naming this setting."""
    checkpoints_max_bytes: ByteCount | None = Field(default=None, ge=1 << 20)
    """Byte bound of the checkpoints store (whole checkpoints: weights, optimizer state, the run's ledger); null:
    none. Only the trainer (and the admin) may read or write it: optimizer state and ledger are not for the
    other roles. Its retention bounds it: step 0's checkpoint and the newest trainer.checkpoint.keep, one more
    while the next is written, about 3x the weights each with AdamW (~11 GB for a 135M-parameter float32 model
    at the defaults). Reserved up front when set, like weights_max_bytes."""
    heartbeat_ttl_s: float = Field(default=15.0, ge=1)
    """A worker that has not written its heartbeat for this long is gone."""
    heartbeat_max_bytes: ByteCount = Field(default=4096, ge=1024)
    """Largest heartbeat value (the workers bucket refuses a bigger put, and readers skip one)."""
    workers_max_bytes: ByteCount = Field(default=16 << 20, ge=1 << 20)
    """Byte bound of the workers (heartbeat) bucket; a full bucket refuses new keys (JetStream reserves it)."""
    state_max_bytes: ByteCount = Field(default=64 << 20, ge=1 << 20)
    """Byte bound of the run's state bucket (config, versions, cursors, credits; JetStream reserves it)."""
    episodes_max_bytes: ByteCount = Field(default=64 << 20, ge=1 << 20)
    """Byte bound of the episodes bucket: the last completed turn of every multi-turn episode in flight (a rollout
    worker that dies mid-episode leaves it to another from there; JetStream reserves it)."""
    episodes_max_age_s: float = Field(default=3600.0, ge=60)
    """An episode's record is dropped this long after its last turn (a finished episode's record is deleted at once;
    this bounds what a dead worker leaves)."""
    max_consumers: int = Field(default=64, ge=4)
    """Consumers each stream, bucket and store of the run accepts; a further create is refused."""

    @model_validator(mode="after")
    def _dedupe_covers_redelivery(self) -> BusConfig:
        if self.duplicate_window_s < self.ack_wait_s:
            raise ValueError(
                f"duplicate_window_s ({self.duplicate_window_s:g}) must be at least ack_wait_s "
                f"({self.ack_wait_s:g}) or a redelivered stage could publish its output twice"
            )
        return self

    @model_validator(mode="after")
    def _limits_fit_their_contents(self) -> BusConfig:
        problems = []
        inline = self.claim_check_bytes + HEADER_BYTES
        if self.max_msg_bytes is not None and self.max_msg_bytes < inline:
            problems.append(
                f"max_msg_bytes ({self.max_msg_bytes}) must be at least claim_check_bytes ({self.claim_check_bytes}) "
                f"+ {HEADER_BYTES} for headers, or a message just under the claim-check threshold would be refused"
            )
        bounds = {"hop_max_bytes": self.hop_max_bytes, "train_max_bytes": self.train_max_bytes}
        bounds |= {"dlq_max_bytes": self.dlq_max_bytes, "events_max_bytes": self.events_max_bytes}
        for name, bound in bounds.items():
            if bound < self.msg_bytes_limit:
                problems.append(
                    f"{name} ({bound}) is smaller than the largest message ({self.msg_bytes_limit}, max_msg_bytes): "
                    "such a message could never be stored"
                )
        if self.workers_max_bytes < 16 * self.heartbeat_max_bytes:
            problems.append(
                f"workers_max_bytes ({self.workers_max_bytes}) must hold at least 16 heartbeats of heartbeat_max_bytes "
                f"({self.heartbeat_max_bytes})"
            )
        if self.media_max_age_s < self.train_max_age_s:
            problems.append(
                f"media_max_age_s ({self.media_max_age_s:g}) must be at least train_max_age_s "
                f"({self.train_max_age_s:g}): a claim-checked train group would lose its payload while the train "
                "stream still keeps it for replay"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def msg_bytes_limit(self) -> int:
        """The largest message a stream of the run stores: `max_msg_bytes`, or claim_check_bytes plus 64 KiB."""
        if self.max_msg_bytes is not None:
            return self.max_msg_bytes
        return self.claim_check_bytes + DEFAULT_HEADROOM


class RunConfig(BaseModel):
    """What the bus needs of a run; stored in the run's KV bucket by `relax init`.

    The RL pipeline (model, task, rewards, rollout, trainer) extends this model in the roles' package
    (its `PipelineConfig`); the bus reads only these fields of a stored config.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    tunable: ClassVar[frozenset[str]] = frozenset(
        {
            "bus.hop_max_msgs",
            "bus.hop_max_bytes",
            "bus.train_max_age_s",
            "bus.train_max_bytes",
            "bus.ack_wait_s",
            "bus.max_deliver",
            "bus.max_ack_pending",
            "bus.duplicate_window_s",
            "bus.dlq_max_age_s",
            "bus.dlq_max_bytes",
            "bus.events_max_msgs",
            "bus.events_max_bytes",
            "bus.claim_check_bytes",
            "bus.max_msg_bytes",
            "bus.media_max_bytes",
            "bus.media_max_age_s",
            "bus.weights_keep",
            "bus.weights_max_bytes",
            "bus.checkpoints_max_bytes",
            "bus.heartbeat_max_bytes",
            "bus.workers_max_bytes",
            "bus.state_max_bytes",
            "bus.max_consumers",
            "hops",  # derived, like chain; a run initialised before hops were stored has none
        }
    )
    """Dotted settings an existing run may change on a second `relax init`; anything else is refused."""

    run: str = Field(pattern=RUN_ID)
    """Run id: letters, digits, '-' and '_' (it names streams and buckets)."""
    groups_per_step: int = Field(default=8, ge=1)
    """Prompt groups per trainer step (one published policy version; the trainer may split them into several
    optimizer updates)."""
    samples_per_group: int = Field(default=8, ge=1, le=4096)
    """Responses sampled per prompt (the GRPO group size)."""
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    """How far rollouts may lag behind the trainer."""
    bus: BusConfig = Field(default_factory=BusConfig)
    """Limits of the run's streams, consumers and stores."""
    hops: tuple[str, ...] = ()
    """Work-queue streams the run has besides the keys its chain passes along (those of the roles a run may
    leave out). Filled in from the role registry, with `chain`; not written by hand."""
    chain: tuple[Role, ...] = ()
    """The roles and the hops they read and write, in order. Filled in from the role registry of the
    process that loads the config (`relax config show` prints it); not written by hand."""

    @model_validator(mode="after")
    def _hop_holds_a_step(self) -> RunConfig:
        if self.bus.hop_max_msgs < self.groups_per_step:
            raise ValueError(
                f"bus.hop_max_msgs ({self.bus.hop_max_msgs}) is smaller than groups_per_step "
                f"({self.groups_per_step}): a step could never be assembled"
            )
        if self.bus.max_ack_pending < self.groups_per_step:
            raise ValueError(
                f"bus.max_ack_pending ({self.bus.max_ack_pending}) is smaller than groups_per_step "
                f"({self.groups_per_step}): the trainer holds a whole step unacked, so it would wait forever"
            )
        if problems := chain_problems(self.chain, self.hops):
            raise ValueError("chain: " + "; ".join(problems))
        return self

    def hop_keys(self) -> tuple[str, ...]:
        """The run's work-queue streams (hops), by key: `hops`, then every other key a role of the chain passes
        along (`relax_bus.chain.hop_keys`)."""
        return hop_keys(self.chain, declared=self.hops)

    @classmethod
    def from_stored(cls: type[C], data: dict[str, Any]) -> C:
        """Validate a stored config, keeping only the sections this model knows (a bus-only reader
        of a pipeline run's config ignores the pipeline's sections)."""
        return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})


C = TypeVar("C", bound=RunConfig, default=RunConfig)
"""A run config model: the bus's own, or one that extends it."""


def incompatible_changes(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted names of settings that differ between `old` and `new` and may not change in a live run."""
    a, b = flattened(old.model_dump()), flattened(new.model_dump())
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and k not in type(new).tunable
    ]


def flattened(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys: `{"trainer": {"optim": {"lr": 1}}}` -> `{"trainer.optim.lr": 1}`."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flattened(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_run_config(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    model: type[C] = RunConfig,  # type: ignore[assignment]
) -> C:
    """Read and validate a YAML or JSON run config as `model`; raise ConfigError listing every problem."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(source, [f"cannot read file: {err.strerror or err}"]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise ConfigError(source, [f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level must be a mapping, got {type(data).__name__}"])
    data.update(overrides or {})
    return parse_run_config(data, source, model)


def parse_run_config(
    data: dict[str, Any],
    source: str = "<config>",
    model: type[C] = RunConfig,  # type: ignore[assignment]
    context: dict[str, Any] | None = None,
) -> C:
    """Validate a run config mapping as `model` (with pydantic's validation `context`); raise ConfigError listing
    every problem."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(source, validation_problems(err)) from None


def validation_problems(err: ValidationError) -> list[str]:
    """One readable line per pydantic error: `dotted.path: message (got value)`."""
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "setting_removed":  # a key of an earlier config: the message names it and its new place
            problems.append(msg)
            continue
        # A whole section (a check across its fields) is not repeated back: the message names what is wrong.
        whole = isinstance(e.get("input"), dict)
        got = "" if e["type"] in {"missing", "extra_forbidden"} or whole else f" (got {e.get('input')!r})"
        if e["type"] == "extra_forbidden":
            msg = "unknown setting"
        elif e["type"] == "union_tag_invalid":  # a plug-in `type` that no registry knows
            ctx = e.get("ctx", {})
            msg, got = f"unknown type {ctx.get('tag')!r} (known: {ctx.get('expected_tags')})", ""
        problems.append(f"{loc}: {msg}{got}")
    return problems

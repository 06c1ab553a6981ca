"""Where a run's metrics go: the metrics role's sinks (`workers.metrics`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from relax_bus.settings import ByteCount
from schemas.bounded import MAX_SAMPLE_TEXT, MAX_STEP_SAMPLES
from workers.config.base import Section
from workers.config.paths import ConfigPath


class WandbConfig(Section):
    """Weights & Biases: a local run directory by default; the service only when asked for."""

    enabled: bool = True
    """Write the run's metrics with the `wandb` library (offline unless `mode: online`: no network needed)."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """`offline`: a run directory under `<dir>/wandb` to upload later with `wandb sync`; `online`: stream to the
    W&B service (its API key comes from wandb's own login, never from the run config); `disabled`: nothing is
    written. `WANDB_MODE`, when set, wins (`WandbEnv`)."""
    project: str = Field(default="relax", min_length=1)
    """W&B project name (`WANDB_PROJECT`, when set, wins)."""
    entity: str | None = None
    """W&B team or user; null: the login's default (`WANDB_ENTITY`, when set, wins)."""


class WandbEnv(BaseSettings):
    """The `WANDB_*` variables of the metrics role's environment that steer its W&B run; each one set wins over the
    run config's `metrics.wandb`. Unset: the config's value (and for `dir`, the metrics directory). The variables
    wandb reads by itself (`WANDB_API_KEY`, `WANDB_BASE_URL`, ...) are left to it."""

    model_config = SettingsConfigDict(env_prefix="WANDB_", extra="ignore", frozen=True)

    mode: Literal["offline", "online", "disabled"] | None = None
    """`WANDB_MODE`: offline, online or disabled."""
    project: str | None = Field(default=None, min_length=1)
    """`WANDB_PROJECT`: the project."""
    entity: str | None = Field(default=None, min_length=1)
    """`WANDB_ENTITY`: the team or user."""
    dir: str | None = Field(default=None, min_length=1)
    """`WANDB_DIR`: where wandb writes its `wandb/` directory (its offline runs); unset: the metrics directory."""
    name: str | None = Field(default=None, min_length=1)
    """`WANDB_NAME`: the run's display name; unset: the run's name."""
    run_id: str | None = Field(default=None, min_length=1, max_length=128)
    """`WANDB_RUN_ID`: the W&B run id; unset: `<run>-<8 hex digits>`, drawn once and kept in the metrics directory."""
    run_group: str | None = Field(default=None, min_length=1)
    """`WANDB_RUN_GROUP`: the group the run belongs to."""
    tags: str | None = None
    """`WANDB_TAGS`: comma-separated tags."""
    notes: str | None = None
    """`WANDB_NOTES`: a description of the run."""


class MetricsConfig(Section):
    """The metrics role: follows the run's events from its own durable consumer and writes every step once
    to each sink below (a restarted role continues where it stopped)."""

    enabled: bool = True
    """Whether the run has a metrics role (`relax run` starts it)."""
    out_dir: ConfigPath | None = None
    """Directory of the file sinks (`metrics.jsonl`, `tensorboard/`, `wandb/`; relative: to the config file's
    directory); null: `<work-dir>/<run>/metrics`
    of the metrics process, and for `relax run` the run directory."""
    jsonl: bool = True
    """Write `metrics.jsonl`: one JSON object per step (`step`, `at` and every value)."""
    tensorboard: bool = True
    """Write TensorBoard event files under `tensorboard/` (open with `tensorboard --logdir <dir>/tensorboard`)."""
    prometheus_port: Annotated[int, Field(ge=1, le=65535)] | Literal["auto"] | None = "auto"
    """Serve Prometheus gauges at `http://<prometheus_host>:<port>/metrics`. `auto`: a free port, which `relax
    run` picks at each launch and prints at the start (a lone `relax worker metrics` logs it as
    `prometheus_serving`); the stored config keeps `auto`. null: none."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (loopback by default: it has no authentication)."""
    poll_s: float = Field(default=5.0, gt=0)
    """How often the Prometheus gauges of queue depths and live workers are read from the server."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases: an offline run directory by default (`wandb: {enabled: false}` turns it off)."""
    samples_per_step: int = Field(default=4, ge=0, le=MAX_STEP_SAMPLES)
    """Trained samples logged per step (prompt, response, reward and its terms): `samples.jsonl` beside
    `metrics.jsonl`, TensorBoard text, a W&B table; 0 turns the samples log off."""
    sample_text_bytes: ByteCount = Field(default=2048, ge=16, le=MAX_SAMPLE_TEXT)
    """Longest prompt, response or error text of a logged sample, in UTF-8 bytes (a longer one is clipped: a
    prompt keeps its end, a response its start)."""


class MetricsLaunch(BaseSettings):
    """What `relax run` resolves for its metrics role at each launch and hands to that process alone, in its
    environment (`RELAX_METRICS_*`): never written into the stored run config, so that running the same
    config again on the same run directory finds the config unchanged and resumes. Unset: the config's own."""

    model_config = SettingsConfigDict(env_prefix="RELAX_METRICS_", extra="ignore", frozen=True)

    dir: str | None = None
    """Where the file sinks write when `metrics.out_dir` is null (`relax run`: its run directory)."""
    prometheus_port: int | None = Field(default=None, ge=1, le=65535)
    """The port of an `auto` `metrics.prometheus_port` (`relax run`: a free one, picked at each launch)."""

    def environment(self) -> dict[str, str]:
        """These settings as the variables they are read from in the role's process."""
        prefix = str(self.model_config.get("env_prefix", ""))
        return {f"{prefix}{k.upper()}": str(v) for k, v in self.model_dump().items() if v is not None}

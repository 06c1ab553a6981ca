"""The trainer's own sections: optimizer, learning-rate schedule, checkpoints, ranks, compute, KL, and
mixture-of-experts routing (`trainer.optim`, `trainer.schedule`, ...). The algorithm's plug-ins are in
`workers.config.trainer`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from workers.config.base import Section
from workers.config.paths import ConfigPath


class OptimConfig(Section):
    """The AdamW optimizer."""

    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate (the peak of the schedule)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay, on matrices only (never on norm scales and biases)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip, applied before every optimizer update."""


class ScheduleConfig(Section):
    """The learning rate over the run's optimizer updates (steps x mini_batches x ppo_epochs)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the schedule after the warm-up."""
    warmup_updates: int = Field(default=0, ge=0)
    """Optimizer updates of linear lr warm-up from lr / warmup_updates to lr."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Where `linear` and `cosine` end, as a fraction of lr."""


class CheckpointConfig(Section):
    """When and where the actor checkpoints."""

    every: int = Field(default=10, ge=1)
    """Steps between checkpoints (model, optimizer, step, settled group ids, ack floor)."""
    keep: int = Field(default=5, ge=1)
    """Newest checkpoints kept besides step 0's; `relax replay` starts from one at or before the step."""
    dir: ConfigPath | None = None
    """Directory for sharded checkpoints (relative: to the config file's directory): every trainer rank writes its
    own shards (safetensors through torch.distributed.checkpoint, in the background) under
    `<dir>/<run>/ckpt-<step>`, and a restart on any number of ranks reads them back. Several nodes need a
    filesystem they all mount there. Null: each checkpoint is gathered on rank 0 and stored whole in the weights
    object store."""


class DistributedConfig(Section):
    """Trainer ranks: one process, or FSDP2 under torchrun on one or several nodes."""

    nproc: int = Field(default=1, ge=1)
    """Trainer processes per node; above 1 runs under torchrun with FSDP2."""
    nnodes: int = Field(default=1, ge=1)
    """Machines the trainer spans, each running `nproc` ranks (world size nnodes x nproc, FSDP2 across all);
    above 1 the nodes meet in torchrun's c10d rendezvous (docs/multinode.md)."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous store, on the first node and reachable from every other; null: `relax
    run` (one machine) picks 127.0.0.1 and a free port, and `relax worker actor` on several machines refuses."""
    rdzv_id: str | None = Field(default=None, min_length=1)
    """Rendezvous id every node of the trainer gives; null: the run id."""

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rdzv_endpoint must be host:port (port 1-65535), got {value!r}")
        return value

    @model_validator(mode="after")
    def _rendezvous_needs_nodes(self) -> DistributedConfig:
        if self.nnodes == 1 and (self.rdzv_endpoint is not None or self.rdzv_id is not None):
            raise ValueError("rdzv_endpoint and rdzv_id are for a trainer on several nodes: set nnodes above 1")
        return self

    @property
    def world_size(self) -> int:
        """Trainer ranks in all: every node runs `nproc`."""
        return self.nnodes * self.nproc


class ComputeConfig(Section):
    """Where a step computes, in what precision, and how it trades memory for compute."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs: `auto` takes the GPU (this rank's LOCAL_RANK under torchrun) when CUDA is present."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: `auto` is bf16 on CUDA (fp32 master weights; FSDP2 reduces in fp32) and fp32 on CPU."""
    micro_batch_tokens: int | None = Field(default=4096, ge=2)
    """Padded tokens (rows x longest sequence) per forward/backward; gradients accumulate over micro-batches
    and the loss is normalised as over the whole mini-batch. null: one pass over the mini-batch. Peak memory
    grows with it: SmolLM2-135M in fp32 on CPU peaks at ~6.7 GB at 2048, ~11.8 GB at 4096 (trainer_memory.py)."""
    shared_prompt: bool = True
    """Forward each distinct prompt of a micro-batch once and reuse its key/value cache for the group's responses
    (the plain pass's log-probs and gradients, with n times less prompt compute). Ignored under FSDP2
    (`distributed.nproc` > 1) and with `activation_checkpointing`, which take the plain pass."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% more compute)."""
    read_ahead: Literal["auto", "on", "off"] = "auto"
    """Fetch and decode the next step's train groups while a step trains, off the step's path. `auto`: on unless
    the update computes on the CPU, where the decoding takes the training's own cores (on 2 cores the demo's step
    took 7-10 % longer with it; `benchmarks/critical_path.py`); off, the rest of a step is still read as it
    arrives, beside the wait for it."""


class KlConfig(Section):
    """The KL penalty to the reference policy."""

    coef: float = Field(default=0.0, ge=0)
    """Weight of the penalty; above 0 puts the reference role in the chain."""
    kind: Literal["k1", "k3", "low_var"] = "low_var"
    """KL estimator."""


class MoeConfig(Section):
    """Mixture-of-experts policies."""

    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Routing replay (docs/r3.md): `r3` forces, in every training forward, the experts the rollout engine routed
    each token to (recorded by the torch engine, carried on the samples); `r2` records the trainer's own routing
    before a step's first update and forces it in the later updates (only matters with mini_batches x ppo_epochs
    > 1); `off` lets the routers choose."""
    metrics_fraction: float = Field(default=0.125, ge=0, le=1)
    """With `r3`: the fraction of each micro-batch's rows (at least one) forwarded once more without replay in a
    step's first update, for `routing_mismatch_free`, the mismatch the trainer would have had without R3; 0 skips
    that forward (and the metric), which on tiny-moe costs about 10 % of a step (docs/r3.md)."""


class SftConfig(Section):
    """Supervised rows mixed into RL: every optimizer update adds `coef` x the mean token cross-entropy of
    `batch_size` examples' answers (prompt tokens masked) to its RL loss (docs/algorithms.md)."""

    dataset: ConfigPath = Field(min_length=1)
    """A JSONL file of examples, one per line: `{"prompt": ..., "answer": ...}` (a `jsonl` task's line with its
    answer) or `{"messages": [...]}` ending in the assistant's answer; on every machine that runs a trainer rank
    (relative paths: to the config file's directory). A missing, empty or bad file is refused before the run starts."""
    coef: float = Field(default=0.1, gt=0)
    """Weight of the supervised loss against the RL loss of each update."""
    batch_size: int = Field(default=8, ge=1)
    """Examples per optimizer update, the next ones in the seeded order (shared out among FSDP2 ranks)."""
    seed: int = 0
    """Seed of the order: each pass over the dataset is a fresh permutation; the update count, which checkpoints
    hold, says where in it an update is, so a restarted actor continues the order."""


class LoraConfig(Section):
    """LoRA (peft): the base stays frozen and only low-rank adapters on `target_modules` train; from v1 on a policy
    version is the adapter alone, fenced by the base's digest (docs/train-your-own-model.md, LoRA)."""

    rank: int = Field(default=8, ge=1)
    """Rank r of each adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) x B A x to the frozen layer's output."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training forwards (engines and the reference never drop)."""
    target_modules: tuple[str, ...] = Field(default=("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1)
    """Names (last path component) of the linear layers that get an adapter, e.g. `[q_proj, v_proj]`."""

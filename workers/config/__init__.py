"""The run config of the RL pipeline: the bus's `RunConfig` plus model, task, rewards, rollout and trainer.

Pure data: importing this module imports pydantic only. Every swappable part is a discriminated union
keyed by `type` (engine, advantage, loss, off-policy correction, reward, task, weight transport), so an
unknown or misspelled plug-in, or an option a known one does not take, is refused by `relax init` and
`relax run` alike, with every problem listed. The implementations live in registries keyed by the same names
(`workers.engines.base.ENGINES`, `workers.training.advantages.ADVANTAGE_ESTIMATORS`,
`workers.training.policy_losses.POLICY_LOSSES`, `workers.training.corrections.CORRECTIONS`,
`workers.rewards.scorer.BUILTINS`, `workers.data.tasks.TASKS`, `workers.weights.TRANSPORTS`); a test
keeps each registry and its union equal. Each family's models are one module of this package
(tasks, rewards, rollout, trainer, weights); adding a plug-in is its model there, one member of the
union, and its implementation in the registry. Each field's docstring is its documentation
(`relax config show`, docs/configuration.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, RootModel, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from relax_bus.chain import LIMITS_STREAMS
from relax_bus.overrides import load_with_overrides
from relax_bus.settings import RunConfig, parse_run_config
from workers.config.agent import AgentConfig, EnvSpec
from workers.config.base import Section
from workers.config.critic import CriticConfig
from workers.config.evaluation import EvalConfig
from workers.config.judge import JudgeConfig
from workers.config.metrics import MetricsConfig, MetricsLaunch, WandbConfig, WandbEnv
from workers.config.model_source import (
    DirSource,
    HfSource,
    ModelSource,
    TinyMoeSource,
    TinyOmniSource,
    TinySource,
)
from workers.config.rewards import (
    AnyReward,
    ExactReward,
    FormatOptions,
    FormatReward,
    MathOptions,
    MathReward,
    NumericOptions,
    NumericReward,
    PythonOptions,
    PythonReward,
    RewardConfig,
)
from workers.config.rollout import EngineConfig, RolloutConfig, SimEngineConfig, TorchEngineConfig, VllmEngineConfig
from workers.config.sampling import SamplingConfig
from workers.config.tasks import (
    AdditionOptions,
    AdditionTask,
    HfOptions,
    HfTask,
    JsonlOptions,
    JsonlTask,
    ReverseOptions,
    ReverseTask,
    TaskConfig,
    task_seed,
    task_spec,
)
from workers.config.teacher import TeacherConfig
from workers.config.trainer import (
    AdvantageConfig,
    CorrectionConfig,
    DrGrpoAdvantage,
    GrpoAdvantage,
    LossConfig,
    SimTrainerConfig,
    TrainerConfig,
    WarmupConfig,
)
from workers.config.weights import BroadcastWeights, FilesystemWeights, ObjectStoreWeights, ShmWeights, WeightsConfig
from workers.role_registry import ROLE_NAMES, ROLES, SCALABLE_ROLES, chain_of

__all__ = [
    "AdditionOptions",
    "AdditionTask",
    "AdvantageConfig",
    "AgentConfig",
    "AnyReward",
    "BroadcastWeights",
    "CorrectionConfig",
    "CriticConfig",
    "DirSource",
    "DrGrpoAdvantage",
    "EngineConfig",
    "EnvSpec",
    "EvalConfig",
    "ExactReward",
    "FilesystemWeights",
    "FormatOptions",
    "FormatReward",
    "GrpoAdvantage",
    "HfOptions",
    "HfSource",
    "HfTask",
    "JsonlOptions",
    "JsonlTask",
    "JudgeConfig",
    "LossConfig",
    "MathOptions",
    "MathReward",
    "MetricsConfig",
    "MetricsLaunch",
    "ModelConfig",
    "ModelSource",
    "NumericOptions",
    "NumericReward",
    "ObjectStoreWeights",
    "PipelineConfig",
    "PythonOptions",
    "PythonReward",
    "ReverseOptions",
    "ReverseTask",
    "RewardConfig",
    "RolesConfig",
    "RolloutConfig",
    "SamplingConfig",
    "ShmWeights",
    "SimEngineConfig",
    "SimTrainerConfig",
    "TaskConfig",
    "TeacherConfig",
    "TinyMoeSource",
    "TinyOmniSource",
    "TinySource",
    "TorchEngineConfig",
    "TrainerConfig",
    "VllmEngineConfig",
    "WandbConfig",
    "WandbEnv",
    "WarmupConfig",
    "WeightsConfig",
    "load_config",
    "parse_config",
    "task_seed",
    "task_spec",
]


class ModelConfig(Section):
    """Where the policy comes from."""

    source: ModelSource = Field(default_factory=TinySource)
    """`{type: tiny, hidden: 128, layers: 2}` (a small Llama built in code), `{type: tiny-moe}` (a small Qwen3-MoE,
    8 experts, top-2; docs/r3.md), `{type: tiny-omni}` (a Qwen2.5-Omni thinker with its processor: text, image,
    audio and video; docs/omni.md), `{type: dir, path: ...}` (a local Hugging Face directory) or `{type: hf, id:
    ..., revision: ..., cache_dir: ...}` (a hub repo, `snapshot_download`ed once into the hub cache that every role
    and vLLM load from). Strings are shorthand: `tiny`, `tiny:<hidden>x<layers>`, `tiny-moe`, `tiny-omni`,
    `hf:<repo>[@<revision>]`, `org/name` (a hub id when no such directory is there), anything else a directory
    (relative: to the config file's directory)."""
    seed: int = 0
    """Seed of the initial weights of a built-in model."""
    prompt_format: Literal["auto", "chat", "raw"] = "auto"
    """How prompt text becomes token ids: `chat` renders it as a user turn with the tokenizer's chat template
    (`add_generation_prompt`), `raw` tokenizes it as is after the tokenizer's BOS (if it has one), `auto` is
    `chat` when the tokenizer has a chat template and `raw` otherwise."""
    system_prompt: str | None = None
    """A system message before every prompt (chat), or text before it (raw); null: none, or the template's own."""


class RolesConfig(RootModel[dict[str, int]]):
    """How many processes of each scalable role `relax run` starts, `{rollout: 2, reward: 1, ...}` (others can join
    with `relax worker`). The keys are the role registry's scalable roles (`workers.role_registry.SCALABLE_ROLES`);
    a role left out gets 1."""

    model_config = ConfigDict(frozen=True)

    root: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _known_roles(cls, data: Any) -> Any:
        # One line per bad key, listed with the others (a single ValueError would join them into one).
        data = {} if data is None else data
        if not isinstance(data, dict):
            return data
        errors = []
        for name, count in data.items():
            problem = None
            if name not in ROLE_NAMES:
                problem = f"unknown role {name!r} (roles with a process count: {', '.join(SCALABLE_ROLES)})"
            elif name not in SCALABLE_ROLES:
                problem = f"the {name} role runs as one process: only {', '.join(SCALABLE_ROLES)} take a process count"
            if problem:
                error = PydanticCustomError("role_count", "{problem}", {"problem": problem})
                errors.append(InitErrorDetails(type=error, loc=(name,), input=count))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="after")
    def _every_role_counted(self) -> RolesConfig:
        # A role left out runs one process; filled in so that a dumped config names every count.
        object.__setattr__(self, "root", {name: self.root.get(name, 1) for name in SCALABLE_ROLES})
        return self

    def count(self, role: str) -> int:
        """Processes of `role` that `relax run` starts."""
        return self.root[role]

    @classmethod
    def rows(cls) -> list[tuple[str, int, str]]:
        """(key, default, meaning) of each key, for the configuration reference."""
        return [(r.name, 1, r.scalable) for r in ROLES if r.scalable]


class PipelineConfig(RunConfig):
    """A whole RL run: the bus's settings plus the pipeline's sections."""

    tunable: ClassVar[frozenset[str]] = (
        RunConfig.tunable
        | {f"roles.{name}" for name in SCALABLE_ROLES}
        | {
            "trainer.checkpoint.every",
            "trainer.checkpoint.keep",
        }
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Where the policy comes from."""
    task: TaskConfig = Field(default_factory=AdditionTask)
    """The prompts and their reference answers: `addition`, `reverse`, `jsonl` or `hf` (a local dataset)."""
    rewards: tuple[RewardConfig, ...] = ()
    """Reward terms (`exact`, `numeric`, `format`, `math`, `python`); empty means the task's default (exact
    match for the built-in tasks)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The actor's optimisation."""
    weights: WeightsConfig = Field(default_factory=ObjectStoreWeights)
    """How weights of each policy version reach the rollout and reference roles."""
    roles: RolesConfig = Field(default_factory=RolesConfig)
    """Process counts for `relax run`."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """The metrics role and its sinks (JSON Lines, TensorBoard, Prometheus, Weights & Biases)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Dynamic sampling: drop groups whose rewards are all equal, replaced by the feeder within a bound."""
    agent: AgentConfig | None = None
    """Multi-turn episodes with an environment on the bus (docs/agentic.md); null: one response per prompt."""
    judge: JudgeConfig | None = None
    """A generative reward model: the `genrm` role asks a judge model about every sample, and its score joins the rule
    rewards (docs/judges.md); null: no judge."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: the `teacher` role scores every sampled token with a teacher model, and the trainer
    takes log p_teacher - log p_sampling as a per-token advantage (docs/algorithms.md); null: no teacher."""
    eval: EvalConfig | None = None
    """Held-out evaluation every few policy versions, logged as `eval/*` (docs/metrics.md); null: none."""
    critic: CriticConfig | None = None
    """PPO with GAE: the `critic` role gives every sampled token a value and trains on the returns, and the actor's
    `gae` advantage uses them (docs/algorithms.md); null: no critic (needs `trainer.advantage: gae`)."""

    @property
    def reference(self) -> bool:
        """Whether the reference role is in the chain (reward -> scored -> reference -> train)."""
        return self.trainer.kl.coef > 0

    @field_validator("rewards")
    @classmethod
    def _distinct_names(cls, rewards: tuple[AnyReward, ...]) -> tuple[AnyReward, ...]:
        labels = [r.label for r in rewards]
        if duplicated := sorted({n for n in labels if labels.count(n) > 1}):
            raise ValueError(f"several rewards named {duplicated}: give each a distinct `name`")
        return rewards

    @model_validator(mode="after")
    def _trainer_fits(self) -> PipelineConfig:
        problems = []
        sequences = self.groups_per_step * self.samples_per_group
        if self.trainer.mini_batches > sequences:
            problems.append(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds the {sequences} sequences of a step "
                f"(groups_per_step x samples_per_group): some updates would have no data"
            )
        budget = self.trainer.compute.micro_batch_tokens
        if budget is not None and budget < self.rollout.max_new_tokens + 1:
            problems.append(
                f"trainer.compute.micro_batch_tokens ({budget}) cannot hold one sequence of rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}) plus its prompt"
            )
        if self.trainer.moe.routing_replay == "r3" and self.rollout.engine.type != "torch":
            problems.append(
                f"trainer.moe.routing_replay r3 needs the rollout engine to record routed experts: only the torch "
                f"engine does (rollout.engine is {self.rollout.engine.type}; docs/r3.md)"
            )
        if self.judge is not None and self.agent is not None:
            problems.append(
                "a judge reads one response per prompt: an agent's episodes are scored by rules or their environment"
            )
        if self.teacher is not None and self.model.source.type == "tiny-omni":
            problems.append("a teacher scores text only: a multimodal policy (tiny-omni) cannot be distilled")
        problems += self._critic_problems()
        if self.trainer.moe.routing_replay == "r3" and self.rollout.partial != "off":
            problems.append(
                f"trainer.moe.routing_replay r3 with rollout.partial {self.rollout.partial}: a continued response's "
                "prefix was routed under older weights than the rest, and routing spans are not recorded; turn one off"
            )
        problems += eval_problems(self)
        problems += self._lora_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _lora_problems(self) -> list[str]:
        """Why `trainer.lora` cannot run with the rest of this config (docs/train-your-own-model.md, LoRA)."""
        if self.trainer.lora is None:
            return []
        problems = []
        if self.model.source.type == "tiny-omni":
            problems.append("trainer.lora trains text policies only: a multimodal policy (tiny-omni) trains in full")
        if self.rollout.engine.type not in ("torch", "vllm"):
            problems.append(
                f"trainer.lora needs the torch or vllm rollout engine, not {self.rollout.engine.type}: they apply "
                "each adapter version (docs/train-your-own-model.md, LoRA)"
            )
        if self.weights.delta:
            problems.append("trainer.lora already publishes only the adapter from v1 on: set weights.delta false")
        if self.trainer.simulate is not None:
            problems.append("trainer.lora with trainer.simulate: a simulated trainer has no adapter to publish")
        return problems

    def _critic_problems(self) -> list[str]:
        """A critic and the `gae` advantage go together, on plain text responses with unshaped rewards."""
        gae = self.trainer.advantage.type == "gae"
        if self.critic is None:
            return ["trainer.advantage gae needs a critic section (the values it is computed from)"] if gae else []
        problems = (
            [] if gae else [f"a critic section needs trainer.advantage gae (it is {self.trainer.advantage.type})"]
        )
        for present, what in (
            (self.teacher is not None, "a teacher (its per-token advantage replaces the critic's)"),
            (self.agent is not None, "an agent's episodes (observation tokens inside a response)"),
            (self.model.source.type == "tiny-omni", "a multimodal policy (tiny-omni)"),
            (self.trainer.overlong is not None, "trainer.overlong (the critic's returns use the unshaped reward)"),
            (self.trainer.lora is not None, "trainer.lora (the critic trains a full copy of the policy)"),
        ):
            if present:
                problems.append(f"a critic does not go with {what}")
        return problems

    @model_validator(mode="after")
    def _counts_of_absent_roles(self) -> PipelineConfig:
        # A dumped config names every count (1 included), so only another count says the user meant one.
        problems = [
            f"roles.{r.name} is {self.roles.count(r.name)} but the run has no {r.name} role ({r.why_absent}): "
            f"leave roles.{r.name} out"
            for r in ROLES
            if r.count_needs_role and not r.enabled(self) and self.roles.count(r.name) != 1
        ]
        if self.agent is not None and self.rollout.partial != "off":
            problems.append(
                f"agent episodes with rollout.partial {self.rollout.partial}: an episode's turns are generated by one "
                "weights version per engine call already; set rollout.partial off"
            )
        if self.agent is not None and self.trainer.moe.routing_replay == "r3":
            problems.append("agent episodes with trainer.moe.routing_replay r3: routing is not recorded across turns")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _fill_chain(self) -> PipelineConfig:
        chain = chain_of(self)
        if self.chain and self.chain != chain:
            raise ValueError("chain is derived from the role registry and the trainer settings; leave it out")
        # Every hop a role of the registry reads, whichever optional roles this run has: a run without the
        # reference role keeps its `scored` stream, so a run's streams do not depend on its settings.
        hops = tuple(r.input for r in ROLES if r.input is not None and r.input not in LIMITS_STREAMS)
        if self.hops and self.hops != hops:
            raise ValueError("hops are derived from the role registry; leave them out")
        # The chain and the hops are functions of the other fields: set them on the frozen model once, here.
        object.__setattr__(self, "chain", chain)
        object.__setattr__(self, "hops", hops)
        return self


def eval_problems(config: PipelineConfig) -> list[str]:
    """What makes the `eval` section unusable with the rest of the run (empty without one)."""
    e = config.eval
    if e is None:
        return []
    problems = []
    if e.dataset.type != config.task.type:
        problems.append(
            f"eval.dataset is a {e.dataset.type} task but the run trains on a {config.task.type} task: the held-out "
            "set must be of the training task's type (it is scored with the same rewards)"
        )
    if config.agent is not None:
        problems.append("eval with agent episodes: the held-out set is answered in one turn; leave eval out")
    if config.model.source.type == "tiny-omni":
        problems.append("eval of a multimodal policy (tiny-omni) is not supported yet; leave eval out")
    return problems


def parse_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    """Validate a pipeline run config mapping; ConfigError listing every problem."""
    return parse_run_config(data, source, PipelineConfig)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate a YAML or JSON pipeline run config; ConfigError listing every problem.

    `overrides` maps dotted keys to values (`{"trainer.optim.lr": 1e-4, "run": "exp2"}`, as
    `relax_bus.overrides.parse_overrides` makes them from `section.key=value` arguments); they are set in
    the file's mapping before validation, so their problems are listed with the file's."""
    return load_with_overrides(path, overrides, PipelineConfig)

"""The role registry: the only list of roles. Everything else (the chain of a run, hence its topology
and NATS permissions, `relax worker`, `relax run`, the test harnesses) reads it.

A role is one module under `workers/roles/` with an `async def serve(ctx: RoleContext) -> None`, plus
one entry here: its name, the hop it reads, the hop it writes, what else it touches (`Grants`), and
when it is part of a run. The module is imported only by the process that runs the role, so a
role whose code needs no torch never loads it. The config derives a run's chain from this module
(`PipelineConfig.chain`), so it sits below `workers.config` and sees a run's config as `RunShape`: what the
entries read of it.

    feeder     publish prompts; write feeder.cursor; watch policy.version; follow dead letters; read the run's
               stream and consumer state (what is still on the bus bounds the dead-letter credit)
    rollout    pull prompts, publish rollouts; read weights, watch policy.version; call the environment service and
               record episodes' turns
    genrm      pull rollouts, publish judged (runs with a judge section)
    reward     pull rollouts (judged in a run with a judge), publish scored (train when the run has no reference,
               teacher or critic role)
    reference  pull scored, publish teach (a run with a teacher), critique (a run with a critic) or train; read
               weights, watch policy.version
    teacher    pull teach (a run with a reference role) or scored, publish train
    critic     pull critique (a run with a reference role) or scored, publish train; write critic.checkpoint and
               its own checkpoints; read weights (version 0), watch policy.version; rewind its durable
    actor      pull train, rewind its durable; publish prompts (requeues); write weights,
               policy.version, trainer.*, groups.dropped
    metrics    follow events (its own durable, rewound to its ack floor), write the sinks; read the
               run's consumer, stream and worker state (Prometheus gauges)
    env        no stream: serve the run's environment (`agent.env`) as a NATS service, replies only
               (runs with an `agent` section)
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from workers.state_keys import (
    CRITIC_CHECKPOINT,
    EVAL_CLAIMED,
    FEEDER_CURSOR,
    GROUPS_DROPPED,
    GROUPS_FILTERED,
    POLICY_VERSION,
    TRAINER_CHECKPOINT,
    TRAINER_DONE,
    TRAINER_STEP,
    WEIGHTS_BROADCAST,
)

if TYPE_CHECKING:
    from relax_bus.chain import Role


class RunShape(Protocol):
    """What the entries read of a run's config (a `workers.config.PipelineConfig`)."""

    @property
    def reference(self) -> bool:
        """Whether the run has the reference role."""

    @property
    def judge(self) -> Any:
        """The judge section (None: no generative reward model, hence no genrm role)."""

    @property
    def teacher(self) -> Any:
        """The teacher section (None: the run distills from no teacher, hence has no teacher role)."""

    @property
    def critic(self) -> Any:
        """The critic section (None: no value model, hence no critic role)."""

    @property
    def roles(self) -> Any:
        """Process counts of the scalable roles (`roles.rollout`, `roles.reward`, `roles.reference`), a
        `workers.config.RolesConfig` with `count(name)`."""

    @property
    def trainer(self) -> Any:
        """The trainer section (`trainer.distributed.nproc`, `trainer.distributed.nnodes`)."""

    @property
    def metrics(self) -> Any:
        """The metrics section (`metrics.enabled`)."""

    @property
    def agent(self) -> Any:
        """The agent section (None: the run has no multi-turn episodes, hence no env role)."""


def _always(config: RunShape) -> bool:
    return True


def _with_reference(config: RunShape) -> bool:
    return config.reference


def _with_judge(config: RunShape) -> bool:
    return config.judge is not None


def _with_teacher(config: RunShape) -> bool:
    return config.teacher is not None


def _with_critic(config: RunShape) -> bool:
    return config.critic is not None


def _with_metrics(config: RunShape) -> bool:
    return config.metrics.enabled


def _with_agent(config: RunShape) -> bool:
    return config.agent is not None


def _one(config: RunShape) -> int:
    return 1


@dataclass(frozen=True)
class RoleDeploy:
    """How one role is deployed, where it differs from the defaults."""

    compose_about: str = ""
    """Comment lines above its compose service."""
    compose_extra: str = ""
    """More keys of its compose service (YAML, indented as the service's keys)."""
    k8s_about: str = "Runs `relax worker {role}` (durable consumer `{role}` of its input hop)."
    """Comment lines at the top of its Kubernetes manifest."""
    k8s_spec: str = ""
    """Keys of its Deployment's spec before the selector (replicas, strategy)."""
    requests: str = "{cpu: 500m, memory: 512Mi}"
    limits: str = "{memory: 1Gi}"
    k8s_container: str = ""
    """More keys of its container (ports)."""
    k8s_more: str = ""
    """More documents of its manifest (a Service)."""
    k8s_pod: str = ""
    """More keys of its pod spec (volumes)."""
    gpus: int = 0
    """NVIDIA GPUs one replica gets in the GPU variants (docker-compose.gpu.yml, deploy/k8s/overlays/gpu)."""
    hand_written: bool = False
    """Its manifest is deploy/k8s/base/<role>.yaml as edited by hand (listed in the kustomization still)."""


@dataclass(frozen=True)
class RoleDef:
    """One role: where it sits in the chain and where its code is."""

    name: str
    input: str | None
    """The hop it reads; every run has this hop, whether the role is in its chain or not (`input_of` may pick
    another for a run)."""
    output: Callable[[RunShape], str | None]
    grants: dict[str, Any]
    """Keyword arguments of its `relax_bus.chain.Grants` (kept plain so reading the registry is cheap)."""
    module: str
    """Module with `async def serve(ctx)`; imported only when the role runs."""
    enabled: Callable[[RunShape], bool] = _always
    """Whether a run with this config has the role."""
    why_absent: str = ""
    """Said when someone starts the role in a run that has none."""
    torch_threads: bool = True
    """Whether `relax worker --threads` applies (the role runs torch)."""
    scalable: str = ""
    """What several processes of the role do, when `relax run` may start several (`roles.<name>` in the run
    config, one by default); empty: the role runs as one process."""
    count_needs_role: bool = False
    """A process count (`roles.<name>`) other than the default is refused in a run without the role (`why_absent`
    says why): counting servers of a run that cannot have them is a mistake, not a setting to keep for later."""
    ranks: Callable[[RunShape], int] = _one
    """Processes per instance: above 1, `relax run` starts the role under torchrun with that many ranks."""
    nodes: Callable[[RunShape], int] = _one
    """Machines one instance spans, each with `ranks` processes: above 1, `relax worker` re-executes itself
    under torchrun with a c10d rendezvous, and `relax run` starts that many torchrun agents on this machine."""
    ends_run: bool = False
    """The run is over when this role exits by itself (the trainer, after its last step)."""
    exits_when_done: bool = False
    """Exits 0 by itself once the run is done (the others run until stopped)."""
    deploy: RoleDeploy = RoleDeploy()
    """How compose and Kubernetes run it (`python -m workers.launch.deploy_files` writes the files from it)."""
    input_of: Callable[[RunShape], str | None] | None = None
    """The hop it reads in a run with `config`, where that depends on which roles come before it (None: `input`)."""
    checks: tuple[str, ...] = ()
    """The pre-start checks (`workers.preflight.CHECKS`) of the parts of the config it uses, run when it starts:
    a config that cannot work for it is refused with exit code 2 before it does anything."""

    def processes(self, config: RunShape) -> int:
        """How many processes of the role `relax run` starts (`roles.<name>` for a scalable role, else 1)."""
        return int(config.roles.count(self.name)) if self.scalable else 1

    def role(self, config: RunShape) -> Role:
        """Its place in the chain of a run with `config`."""
        from relax_bus.chain import Grants, Role

        hop = self.input if self.input_of is None else self.input_of(config)
        return Role(name=self.name, input=hop, output=self.output(config), grants=Grants(**self.grants))

    def serve(self) -> Callable[[Any], Awaitable[None]]:
        """The role's entry point (imports its module)."""
        fn: Callable[[Any], Awaitable[None]] = importlib.import_module(self.module).serve
        return fn


SANDBOX_COMPOSE = (
    "# Code-executing rewards run in the reward sandbox's own namespaces (docs/sandbox.md): the engine's\n"
    "# default seccomp profile plus unshare, mount, umount2 and pivot_root, and no AppArmor profile (the\n"
    "# engines' default one denies mount). Without them such rewards are refused at start.\n"
    "security_opt:\n"
    "  - seccomp=./deploy/seccomp/reward-sandbox.json\n"
    "  - apparmor=unconfined\n"
    "  - no-new-privileges:true"
)
"""The compose settings of a role that runs code in the reward sandbox (the reward role; the env role's python
tool)."""
SANDBOX_K8S = (
    "securityContext:\n"
    "  seccompProfile:                 # code-executing rewards need their sandbox's namespaces\n"
    "    type: Localhost\n"
    "    localhostProfile: relax/reward-sandbox.json"
)
"""The Kubernetes container settings of such a role."""

ROLES: tuple[RoleDef, ...] = (
    RoleDef(
        "feeder",
        input=None,
        output=lambda c: "prompts",
        grants=dict(
            state_keys=(FEEDER_CURSOR,), reaps=False, reads_dead_letters=True, watches_version=True, observes=True
        ),
        module="workers.roles.feeder",
        deploy=RoleDeploy(
            k8s_about=(
                "Publishes the prompts of each step; keeps its place in KV (feeder.cursor), so a rescheduled feeder\n"
                "continues where the last one stopped. It exits 0 once the run is done."
            ),
            k8s_spec=(
                "replicas: 1\nstrategy:\n"
                "  type: Recreate                  # one feeder at a time: it owns feeder.cursor"
            ),
            requests="{cpu: 250m, memory: 512Mi}",
        ),
        torch_threads=False,
        exits_when_done=True,
        checks=("task",),
    ),
    RoleDef(
        "rollout",
        input="prompts",
        output=lambda c: "rollouts",
        grants=dict(
            reads_weights=True,
            watches_version=True,
            calls_env=True,
            records_episodes=True,
            state_keys=(EVAL_CLAIMED,),  # the held-out evaluation's claims (`workers.roles.evaluation`)
        ),
        module="workers.roles.rollout",
        deploy=RoleDeploy(
            compose_extra="deploy:\n  mode: replicated\n  replicas: 2",
            k8s_about=(
                "Generates groups from the prompts (durable consumer `rollout` of RELAX_<run>_PROMPTS). Stateless:\n"
                "replicas share the durable, and KEDA (scaledobjects.yaml) sets their number from its lag."
            ),
            requests='{cpu: "1", memory: 2Gi}',
            limits="{memory: 4Gi}",
            gpus=1,
        ),
        scalable="Rollout (generation) processes; they share the durable of the prompts hop.",
        checks=("model", "prompt_format", "engine"),
    ),
    RoleDef(
        "genrm",
        input="rollouts",
        output=lambda c: "judged",
        grants={},
        module="workers.roles.genrm",
        deploy=RoleDeploy(
            compose_about=(
                "Only runs with a judge section have a genrm role (a generative reward model; examples/compose.yaml\n"
                "has none, and a genrm worker of a run without one exits with an error): docker compose --profile\n"
                "genrm up -d"
            ),
            compose_extra='profiles: ["genrm"]',
            k8s_about=(
                "A judge model's verdict on every sample (durable consumer `genrm` of RELAX_<run>_ROLLOUTS). A genrm\n"
                "worker of a run without the role exits with an error: scale it up only where it exists."
            ),
            k8s_spec="replicas: 0                       # only runs with a judge section have one",
            requests='{cpu: "1", memory: 2Gi}',
            limits="{memory: 4Gi}",
        ),
        enabled=_with_judge,
        why_absent="the run has no judge section",
        count_needs_role=True,
        scalable="Judge processes; they share the durable of the rollouts hop.",
        checks=("task", "judge"),
    ),
    RoleDef(
        "reward",
        input="judged",
        input_of=lambda c: "judged" if c.judge is not None else "rollouts",
        output=lambda c: "scored" if c.reference or c.teacher is not None or c.critic is not None else "train",
        grants=dict(state_keys=(GROUPS_FILTERED,)),  # dynamic sampling's filtered set
        module="workers.roles.reward",
        deploy=RoleDeploy(
            compose_extra="deploy:\n  mode: replicated\n  replicas: 2\n" + SANDBOX_COMPOSE,
            k8s_about=(
                "Scores rollouts (durable consumer `reward` of RELAX_<run>_ROLLOUTS). Stateless; KEDA scales it.\n"
                "Its seccomp profile is RuntimeDefault plus what the reward sandbox needs: deploy/seccomp/\n"
                "reward-sandbox.json must be on every node that runs it, as <kubelet root>/seccomp/relax/\n"
                "reward-sandbox.json (docs/sandbox.md); without it the pod does not start."
            ),
            k8s_container=SANDBOX_K8S,
        ),
        torch_threads=False,
        scalable="Reward (scoring) processes; they share the durable of the rollouts hop.",
        checks=("task", "rewards"),
    ),
    RoleDef(
        "reference",
        input="scored",
        output=lambda c: "teach" if c.teacher is not None else "critique" if c.critic is not None else "train",
        grants=dict(reads_weights=True, watches_version=True),
        module="workers.roles.reference",
        deploy=RoleDeploy(
            compose_about=(
                "Only runs with trainer.kl.coef > 0 have a reference role (examples/compose.yaml has none; a\n"
                "reference worker of a run without one exits with an error): docker compose --profile reference up -d"
            ),
            compose_extra='profiles: ["reference"]',
            k8s_about=(
                "Reference log-probs for the KL term (durable consumer `reference` of RELAX_<run>_SCORED). A\n"
                "reference worker of a run without the role exits with an error: scale it up only where it exists."
            ),
            k8s_spec=(
                "replicas: 0                       # only runs with trainer.kl.coef > 0 have one (the demo has none)"
            ),
            requests='{cpu: "1", memory: 2Gi}',
            limits="{memory: 4Gi}",
        ),
        enabled=_with_reference,
        why_absent="trainer.kl.coef is 0",
        scalable="Reference processes; ignored while `trainer.kl.coef` is 0 (the run then has no reference role).",
        checks=("model",),
    ),
    RoleDef(
        "teacher",
        input="teach",
        input_of=lambda c: "teach" if c.reference else "scored",
        output=lambda c: "train",
        grants={},
        module="workers.roles.teacher",
        deploy=RoleDeploy(
            compose_about=(
                "Only runs with a teacher section have a teacher role (on-policy distillation; examples/compose.yaml\n"
                "has none, and a teacher worker of a run without one exits with an error): docker compose --profile\n"
                "teacher up -d"
            ),
            compose_extra='profiles: ["teacher"]',
            k8s_about=(
                "The teacher's log-probs of every sampled token, for on-policy distillation (durable consumer\n"
                "`teacher` of RELAX_<run>_SCORED, or of RELAX_<run>_TEACH in a run with a reference role). A teacher\n"
                "worker of a run without the role exits with an error: scale it up only where it exists."
            ),
            k8s_spec="replicas: 0                       # only runs with a teacher section have one",
            requests='{cpu: "1", memory: 2Gi}',
            limits="{memory: 4Gi}",
        ),
        enabled=_with_teacher,
        why_absent="the run has no teacher section",
        count_needs_role=True,
        scalable="Teacher processes; they share the durable of their input hop.",
        checks=("model", "teacher"),
    ),
    RoleDef(
        "critic",
        input="critique",
        input_of=lambda c: "critique" if c.reference else "scored",
        output=lambda c: "train",
        grants=dict(
            state_keys=(CRITIC_CHECKPOINT,),
            reads_weights=True,
            watches_version=True,
            writes_checkpoints=True,
            reaps=False,
            resets_consumer=True,
        ),
        module="workers.roles.critic",
        deploy=RoleDeploy(
            compose_about=(
                "Only runs with a critic section have a critic role (PPO with GAE; examples/compose.yaml has none,\n"
                "and a critic worker of a run without one exits with an error): docker compose --profile critic up -d"
            ),
            compose_extra='profiles: ["critic"]',
            k8s_about=(
                "The value model of PPO with GAE (durable consumer `critic` of RELAX_<run>_SCORED, or of\n"
                "RELAX_<run>_CRITIQUE in a run with a reference role). One replica: it owns critic.checkpoint. A\n"
                "critic worker of a run without the role exits with an error: scale it up only where it exists."
            ),
            k8s_spec=(
                "replicas: 0                       # only runs with a critic section have one\nstrategy:\n"
                "  type: Recreate                  # one critic at a time: it owns critic.checkpoint"
            ),
            requests='{cpu: "1", memory: 2Gi}',
            limits="{memory: 4Gi}",
            gpus=1,
        ),
        enabled=_with_critic,
        why_absent="the run has no critic section",
        checks=("model",),
    ),
    RoleDef(
        "actor",
        input="train",
        output=lambda c: None,
        grants=dict(
            state_keys=(
                POLICY_VERSION,
                GROUPS_DROPPED,
                TRAINER_STEP,
                TRAINER_CHECKPOINT,
                TRAINER_DONE,
                WEIGHTS_BROADCAST,
            ),
            publishes=("prompts",),
            reads_weights=True,
            writes_weights=True,
            reaps=False,
            resets_consumer=True,
        ),
        module="workers.roles.actor",
        deploy=RoleDeploy(
            compose_about="Warm-up, version 0, then trainer.steps GRPO steps; exits 0 when the run is done.",
            hand_written=True,
            gpus=1,
        ),
        ranks=lambda c: c.trainer.distributed.nproc,
        nodes=lambda c: c.trainer.distributed.nnodes,
        ends_run=True,
        exits_when_done=True,
        checks=("model", "task", "sft"),
    ),
    RoleDef(
        "metrics",
        input="events",
        output=lambda c: None,
        grants=dict(reaps=False, resets_consumer=True, observes=True),
        module="workers.roles.metrics",
        deploy=RoleDeploy(
            compose_about=(
                "The run's metrics and events into .relax/work/<run>/metrics/ of the relax-work volume: "
                "metrics.jsonl,\nTensorBoard event files and an offline W&B run (docs/metrics.md); restarted, "
                "it continues from its\n"
                "durable. Its Prometheus endpoint (the run config's metrics.prometheus_port, 9464 in\n"
                "examples/compose.yaml) is published on loopback: curl -s 127.0.0.1:9464/metrics"
            ),
            compose_extra='ports:\n  - "127.0.0.1:${RELAX_METRICS_PORT:-9464}:9464"',
            k8s_about=(
                "The metrics role: follows the run's events and serves Prometheus gauges on the `metrics` port (the\n"
                "run config's metrics.prometheus_port, on 0.0.0.0: base/run.yaml), behind the Service below and the\n"
                "ServiceMonitor (servicemonitor.yaml). Its file sinks (metrics.jsonl, TensorBoard, W&B) go to\n"
                "<work-dir>/<run>/metrics on the volume claim relax-metrics, so they outlive the pod; restarted, it\n"
                "continues from its durable."
            ),
            k8s_spec=(
                "replicas: 1\nstrategy:\n"
                "  type: Recreate                  # one pod at a time: it holds relax-metrics (ReadWriteOnce)"
            ),
            requests="{cpu: 100m, memory: 256Mi}",
            limits="{memory: 512Mi}",
            k8s_container=(
                "ports:\n  - name: metrics\n    containerPort: 9464\n"
                "volumeMounts:\n  - name: metrics                 # --work-dir: <run>/metrics is the sinks' directory\n"
                "    mountPath: /var/lib/relax/.relax/work"
            ),
            k8s_pod="volumes:\n  - name: metrics\n    persistentVolumeClaim:\n      claimName: relax-metrics",
            k8s_more=(
                "apiVersion: v1\n"
                "kind: Service\n"
                "metadata:\n"
                "  name: relax-metrics\n"
                "  labels:\n"
                "    app.kubernetes.io/component: metrics\n"
                "spec:\n"
                "  selector:\n"
                "    app.kubernetes.io/component: metrics\n"
                "  ports:\n"
                "    - name: metrics\n"
                "      port: 9464\n"
                "      targetPort: metrics\n"
                "---\n"
                "apiVersion: v1\n"
                "kind: PersistentVolumeClaim\n"
                "metadata:\n"
                "  name: relax-metrics\n"
                "  labels:\n"
                "    app.kubernetes.io/component: metrics\n"
                "spec:\n"
                "  accessModes: [ReadWriteOnce]\n"
                "  resources:\n"
                "    requests:\n"
                "      storage: 2Gi                # metrics.jsonl, TensorBoard and W&B files of the runs\n"
                "  # storageClassName: standard     # the cluster's default class when unset"
            ),
        ),
        enabled=_with_metrics,
        why_absent="metrics.enabled is false",
        torch_threads=False,
    ),
    RoleDef(
        "env",
        input=None,
        output=lambda c: None,
        grants=dict(serves_env=True, reaps=False),
        module="workers.roles.env",
        deploy=RoleDeploy(
            compose_about=(
                "Environment servers of agentic runs (runs with an `agent` section; examples/compose.yaml has none,\n"
                "and an env worker of a run without one exits with an error): docker compose --profile env up -d"
            ),
            compose_extra='profiles: ["env"]\n' + SANDBOX_COMPOSE,
            k8s_about=(
                "Environment servers of agentic runs: a NATS service (`relax-env`) whose instances share the run's\n"
                "reset queue group; no stream. An env worker of a run without an `agent` section exits with an\n"
                "error: scale it up only where the run has one. The python tool runs the reward sandbox, hence the\n"
                "seccomp profile of the reward role (deploy/seccomp/reward-sandbox.json on every node,\n"
                "docs/sandbox.md)."
            ),
            k8s_spec="replicas: 0                       # only runs with an agent section have one (the demo has none)",
            k8s_container=SANDBOX_K8S,
        ),
        enabled=_with_agent,
        why_absent="the run has no agent section",
        count_needs_role=True,
        torch_threads=False,
        scalable="Environment server processes; they share the reset queue group.",
    ),
)
ROLE_NAMES = tuple(r.name for r in ROLES)
SCALABLE_ROLES = tuple(r.name for r in ROLES if r.scalable)
"""The roles `relax run` may start several processes of: the keys of the run config's `roles` map."""


def role_def(name: str) -> RoleDef:
    """The registry entry of `name`; ValueError naming the known roles otherwise."""
    for r in ROLES:
        if r.name == name:
            return r
    raise ValueError(f"unknown role {name!r} (roles: {', '.join(ROLE_NAMES)})")


def chain_of(config: RunShape) -> tuple[Role, ...]:
    """The roles of a run with `config`, in order."""
    return tuple(r.role(config) for r in ROLES if r.enabled(config))

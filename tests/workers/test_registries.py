"""Every plug-in registry and the config union that names its types stay equal, and the role registry
is the only list of roles in the product code."""

import ast
import pathlib
import typing

import pytest

from workers import config
from workers.data.tasks import TASKS
from workers.engines.base import ENGINES
from workers.rewards.scorer import BUILTINS, CHILD_BUILTINS
from workers.role_registry import ROLE_NAMES, ROLES, chain_of
from workers.training.advantages import ADVANTAGE_ESTIMATORS
from workers.training.corrections import CORRECTIONS
from workers.training.policy_losses import POLICY_LOSSES
from workers.weights import TRANSPORTS

pytestmark = pytest.mark.workers
ROOT = pathlib.Path(__file__).resolve().parents[2]


def tags(union: object) -> set[str]:
    """The `type` values of a discriminated union's members."""
    members = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["type"].annotation)[0] for m in members}


@pytest.mark.parametrize(
    ("union", "registry"),
    [
        (config.EngineConfig, set(ENGINES)),
        (config.AdvantageConfig, set(ADVANTAGE_ESTIMATORS)),
        (config.LossConfig, set(POLICY_LOSSES)),
        (config.CorrectionConfig, set(CORRECTIONS)),
        (config.RewardConfig, {*BUILTINS, *CHILD_BUILTINS, "python"}),
        (config.TaskConfig, set(TASKS)),
        (config.WeightsConfig, set(TRANSPORTS)),
    ],
    ids=["engine", "advantage", "loss", "correction", "reward", "task", "weights"],
)
def test_config_union_and_registry_name_the_same_plug_ins(union, registry):
    assert tags(union) == registry


def test_every_role_module_has_serve_and_the_chain_follows_the_config():
    for entry in ROLES:
        assert callable(entry.serve()), entry.name
    plain = config.parse_config({"run": "r"})
    with_kl = config.parse_config({"run": "r", "trainer": {"kl": {"coef": 0.1}}})
    assert [r.name for r in chain_of(plain)] == ["feeder", "rollout", "reward", "actor", "metrics"]
    no_metrics = config.parse_config({"run": "r", "metrics": {"enabled": False}})
    assert [r.name for r in chain_of(no_metrics)] == ["feeder", "rollout", "reward", "actor"]
    assert [(r.name, r.output) for r in chain_of(with_kl)][2:4] == [("reward", "scored"), ("reference", "train")]


# A role's own module may name its role; these other literals are not role names (message fields).
NOT_ROLES = {
    ("schemas/messages.py", "rollout"),  # the stage named in a rollout group's publish id
    ("workers/cli.py", "metrics"),  # the summary's metrics.jsonl path, not the role
    ("workers/launch/launcher.py", "metrics"),
    ("workers/cli.py", "env"),  # the `relax env` command
    ("workers/config/agent.py", "env"),  # agent.reward: the environment's step rewards
    ("workers/launch/grant_table.py", "env"),  # the agent section's `env` key
    ("relax_bus/topology.py", "env"),  # the environment servers' queue group
    ("workers/envs/client.py", "reward"),  # a step reply's field
    ("workers/envs/service.py", "reward"),
    ("workers/envs/service.py", "env"),  # the server's thread names
    ("workers/roles/reward.py", "env"),  # agent.reward's values and the episode's `env` reward term
    ("workers/rewards/sandbox/client.py", "reward"),  # who the sandbox runs code for, in its refusal line
    ("workers/config/judge.py", "reference"),  # the judge template's `{reference}` field (the task's answer)
    ("workers/launch/judge_train.py", "reference"),  # the labelled pair's `reference` key
    ("workers/launch/judge_data.py", "reference"),  # a labelled pair's reference answer
    ("workers/metrics/samples.py", "reward"),  # a samples table's column
    ("workers/preflight.py", "teacher"),  # the `teacher` pre-start check (of the teacher section)
    ("workers/training/batch.py", "reference"),  # which log-probs a refusal line is about
    ("workers/training/batch.py", "teacher"),
    ("workers/training/batch.py", "critic"),
}


def role_literals() -> list[tuple[str, int, str]]:
    found = []
    for package in ("schemas", "relax_bus", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where == "workers/role_registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in ROLE_NAMES:
                    own_module = where == f"workers/roles/{node.value}.py"
                    if not own_module and (where, node.value) not in NOT_ROLES:
                        found.append((where, node.lineno, node.value))
    return found


def test_the_registry_is_the_only_list_of_roles():
    """A role name written as a string outside the registry (and the role's own module) is a second
    list of roles in the making: read the registry (`role_def`, `chain_of`, `ROLES`) instead."""
    assert role_literals() == []

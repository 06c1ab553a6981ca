"""`roles`: process counts of the role registry's scalable roles, checked against the registry."""

import pytest

from relax_bus.errors import ConfigError
from relax_bus.overrides import parse_overrides
from workers.config import PipelineConfig, load_config, parse_config
from workers.role_registry import ROLES, SCALABLE_ROLES, role_def


def problems_of(roles) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config({"run": "r", "roles": roles})
    return err.value.problems


def test_counts_default_to_one_and_the_registry_reads_them():
    config = parse_config({"run": "r", "roles": {"rollout": 3}, "trainer": {"kl": {"coef": 0.1}}})
    assert config.model_dump()["roles"] == {
        "rollout": 3,
        "genrm": 1,
        "reward": 1,
        "reference": 1,
        "teacher": 1,
        "env": 1,
    }
    assert {r.name: r.processes(config) for r in ROLES} == {
        "feeder": 1,
        "rollout": 3,
        "genrm": 1,
        "reward": 1,
        "reference": 1,
        "actor": 1,
        "metrics": 1,
        "teacher": 1,
        "critic": 1,
        "env": 1,
    }
    assert set(SCALABLE_ROLES) == {"rollout", "genrm", "reward", "reference", "teacher", "env"}


def test_unknown_and_single_process_roles_are_refused_each_on_one_line():
    problems = problems_of({"rollouts": 2, "actor": 2, "feeder": 1, "reward": 2})
    counted = "rollout, genrm, reward, reference, teacher, env"
    assert problems == [
        f"roles.rollouts: unknown role 'rollouts' (roles with a process count: {counted}) (got 2)",
        f"roles.actor: the actor role runs as one process: only {counted} take a process count (got 2)",
        f"roles.feeder: the feeder role runs as one process: only {counted} take a process count (got 1)",
    ]


def test_a_negative_count_is_refused():
    assert problems_of({"reward": -1}) == ["roles.reward: Input should be greater than or equal to 0 (got -1)"]


def test_a_dotted_override_sets_one_count(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run: r\nroles: {reward: 2}\n")
    config = load_config(path, parse_overrides(["roles.rollout=4"]))
    assert (config.roles.count("rollout"), config.roles.count("reward")) == (4, 2)
    assert role_def("rollout").processes(config) == 4


def test_every_scalable_role_count_is_tunable():
    assert {f"roles.{name}" for name in SCALABLE_ROLES} <= PipelineConfig.tunable


AGENT = {"env": {"type": "calculator"}}


def test_env_servers_are_counted_only_in_a_run_with_an_agent_section():
    config = parse_config({"run": "r", "roles": {"env": 2}, "agent": AGENT})
    assert config.roles.count("env") == 2 and role_def("env").processes(config) == 2
    assert [r.name for r in config.chain][-1] == "env"
    (problem,) = problems_of({"env": 2})
    assert "roles.env is 2 but the run has no env role (the run has no agent section): leave roles.env out" in problem
    plain = parse_config({"run": "r"})
    assert "env" not in [r.name for r in plain.chain]
    assert parse_config(plain.model_dump()).roles.count("env") == 1, "a dumped config (env: 1) reads back"


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"rollout": {"partial": "continue"}}, "agent episodes with rollout.partial continue"),
        ({"trainer": {"moe": {"routing_replay": "r3"}}}, "agent episodes with trainer.moe.routing_replay r3"),
    ],
)
def test_what_episodes_cannot_run_with_is_refused_at_parse(extra, said):
    with pytest.raises(ConfigError, match=said):
        parse_config({"run": "r", "agent": AGENT, **extra})

import pytest

from relax_bus.topology import build_topology
from workers.config import parse_config


def test_subjects_streams_and_roles():
    t = build_topology(parse_config({"run": "r1"}))
    assert [t.subject(k) for k in t.subject_keys] == [f"relax.r1.{k}" for k in t.subject_keys]
    assert t.subject_keys == ("prompts", "rollouts", "judged", "scored", "teach", "critique", "train", "dlq", "events")
    assert t.stream("prompts").retention == "workqueue" and t.stream("prompts").discard == "new"
    assert t.stream("train").retention == "limits"
    assert t.role("reward").output == "train"
    assert [c.durable for c in t.consumers] == ["rollout", "reward", "actor", "metrics"]
    with pytest.raises(KeyError, match="unknown role 'reference'"):
        t.role("reference")


def test_reference_joins_the_chain_when_enabled():
    t = build_topology(parse_config({"run": "r1", "trainer": {"kl": {"coef": 0.01}}}))
    assert t.role("reward").output == "scored"
    assert t.role("reference").input == "scored" and t.role("reference").output == "train"
    assert [c.durable for c in t.consumers] == ["rollout", "reward", "reference", "actor", "metrics"]


def test_limits_come_from_the_config():
    t = build_topology(parse_config({"run": "r1", "bus": {"max_deliver": 9, "hop_max_msgs": 77, "replicas": 3}}))
    assert t.consumer("prompts").max_deliver == 9
    assert t.stream("rollouts").max_msgs == 77
    assert all(s.replicas == 3 for s in t.streams)


def test_hops_come_from_the_chain():
    from relax_bus.chain import Grants, Role, chain_problems, hop_keys

    chain = (
        Role(name="source", output="raw"),
        Role(name="clean", input="raw", output="clean"),
        Role(name="judge", input="clean", output="train", grants=Grants(publishes=("raw",))),
        Role(name="learner", input="train"),
    )
    assert hop_keys(chain) == ("raw", "clean")  # a new hop is a key the roles pass along; train is a limits stream
    assert hop_keys(chain, declared=("extra", "train")) == ("extra", "raw", "clean")
    assert chain_problems(chain) == []
    orphan = (*chain, Role(name="late", input="nowhere"))
    assert chain_problems(orphan) == ["role late: input 'nowhere' is a hop no role of the chain publishes to"]
    assert "is not a stream key" in chain_problems((Role(name="bad", output="Bad.Key"),))[0]

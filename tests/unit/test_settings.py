import pytest

from relax_bus.errors import ConfigError
from relax_bus.settings import ConnectionSettings, incompatible_changes
from relax_bus.topology import build_topology
from workers.config import load_config, parse_config


def test_minimal_config_gets_defaults():
    c = parse_config({"run": "r1"})
    assert c.staleness.max_staleness == 1 and c.bus.storage == "file"


@pytest.mark.parametrize("word", ["unbounded", "Unbounded", "inf", "none"])
def test_unbounded_staleness(word):
    assert parse_config({"run": "r1", "staleness": {"max_staleness": word}}).staleness.max_staleness is None


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "run: 'bad id!'\n"
        "groups_per_step: zero\n"
        "samples_per_group: -1\n"
        "staleness: {max_staleness: -2, action: explode}\n"
        "bus: {storage: tape, typo_field: 1}\n"
        "unknown_top: 3\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    text = str(err)
    assert len(err.problems) == 8, err.problems
    for where in (
        "run:",
        "groups_per_step:",
        "samples_per_group:",
        "staleness.max_staleness:",
        "staleness.action:",
        "bus.storage:",
        "bus.typo_field: unknown setting",
        "unknown_top: unknown setting",
    ):
        assert where in text
    assert str(path) in text


def test_contradictory_settings_are_explained():
    with pytest.raises(ConfigError, match=r"duplicate_window_s .* must be at least ack_wait_s"):
        parse_config({"run": "r1", "bus": {"ack_wait_s": 600, "duplicate_window_s": 60}})
    with pytest.raises(ConfigError, match="smaller than groups_per_step"):
        parse_config({"run": "r1", "groups_per_step": 64, "bus": {"hop_max_msgs": 10}})


def test_a_dead_workers_messages_come_back_in_seconds_by_default():
    """ack_wait bounds how long a SIGKILLed worker's messages stay out of reach (benchmarks/redelivery.py); a live
    worker keeps its own alive every ack_wait/4, and the dedupe window still covers a redelivery."""
    bus = parse_config({"run": "r1"}).bus
    assert bus.ack_wait_s <= 15
    assert bus.duplicate_window_s >= bus.ack_wait_s


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(broken)


def test_incompatible_changes_ignore_tunables():
    a = parse_config({"run": "r1"})
    b = parse_config({"run": "r1", "bus": {"max_ack_pending": 70, "ack_wait_s": 90}})
    assert incompatible_changes(a, b) == []
    c = parse_config({"run": "r1", "groups_per_step": 3, "staleness": {"max_staleness": 0}})
    changes = incompatible_changes(a, c)
    assert changes == ["groups_per_step: 8 -> 3", "staleness.max_staleness: 1 -> 0"]


def test_connection_settings_from_environment(monkeypatch):
    monkeypatch.setenv("RELAX_NATS_URL", "nats://a:1, nats://b:2")
    monkeypatch.setenv("RELAX_USER", "rollout")
    s = ConnectionSettings()
    assert s.nats_url == ["nats://a:1", "nats://b:2"] and s.user == "rollout"


def test_tls_cert_needs_key():
    with pytest.raises(ValueError, match="given together"):
        ConnectionSettings(tls_cert_file="/c.pem")


def test_wrong_types_and_out_of_range_values_are_named():
    with pytest.raises(ConfigError) as info:
        parse_config(
            {
                "run": "r1",
                "groups_per_step": 0,
                "samples_per_group": 1.5,
                "staleness": {"max_staleness": -1, "max_requeues": "twice"},
                "rollout": {"engine": "tensorrt", "temperature": 0, "top_p": 1.5, "batch_groups": []},
                "trainer": {"steps": "many", "kl": {"coef": -0.1}},
                "roles": {"rollout": -1},
            }
        )
    problems = "\n".join(info.value.problems)
    assert len(info.value.problems) == 11, problems
    for what in (
        "groups_per_step: Input should be greater than or equal to 1 (got 0)",
        "samples_per_group: Input should be a valid integer, got a number with a fractional part (got 1.5)",
        "staleness.max_staleness: Input should be greater than or equal to 0 (got -1)",
        "staleness.max_requeues: Input should be a valid integer",
        "rollout.engine: unknown type 'tensorrt' (known: 'torch', 'vllm', 'sim')",
        "rollout.temperature: Input should be greater than 0",
        "rollout.top_p: Input should be less than or equal to 1",
        "rollout.batch_groups: Input should be a valid integer",
        "trainer.steps: Input should be a valid integer",
        "trainer.kl.coef: Input should be greater than or equal to 0",
        "roles.rollout: Input should be greater than or equal to 0",
    ):
        assert what in problems


def test_more_contradictions_are_explained():
    with pytest.raises(ConfigError, match=r"low \(2\.0\) must be below high \(2\.0\)"):
        parse_config({"run": "r1", "trainer": {"correction": {"type": "tis", "low": 2.0}}})
    with pytest.raises(ConfigError, match=r"hop_max_msgs \(1\) is smaller than groups_per_step \(2\)"):
        parse_config({"run": "r1", "groups_per_step": 2, "bus": {"hop_max_msgs": 1}})
    with pytest.raises(ConfigError, match=r"max_ack_pending \(2\) is smaller than groups_per_step \(4\)"):
        parse_config({"run": "r1", "groups_per_step": 4, "bus": {"max_ack_pending": 2}})


def test_reference_workers_without_kl_coef_are_not_in_the_chain():
    """roles.reference only counts when trainer.kl.coef > 0; `relax worker reference` is refused otherwise."""
    off = build_topology(parse_config({"run": "r1", "roles": {"reference": 3}}))
    assert [r.name for r in off.roles] == ["feeder", "rollout", "reward", "actor", "metrics"]
    assert off.role("reward").output == "train"
    on = build_topology(parse_config({"run": "r1", "trainer": {"kl": {"coef": 0.1}}, "roles": {"reference": 0}}))
    assert on.role("reward").output == "scored" and on.role("reference").output == "train"


def test_connection_retry_is_bounded_by_a_setting(monkeypatch):
    assert ConnectionSettings().connect_retry_s == 60.0
    monkeypatch.setenv("RELAX_CONNECT_RETRY_S", "0")
    assert ConnectionSettings().connect_retry_s == 0.0
    with pytest.raises(ValueError, match="connect_retry_s"):
        ConnectionSettings(connect_retry_s=-1)


def test_byte_sizes_take_units_and_stay_ints():
    c = parse_config(
        {
            "run": "r1",
            "bus": {"hop_max_bytes": "512MiB", "train_max_bytes": "3GB", "claim_check_bytes": 65536},
            "metrics": {"sample_text_bytes": "4KiB"},
        }
    )
    sizes = (c.bus.hop_max_bytes, c.bus.train_max_bytes, c.bus.claim_check_bytes, c.metrics.sample_text_bytes)
    assert sizes == (512 << 20, 3 * 10**9, 65536, 4096)
    assert all(type(size) is int for size in sizes)  # not ByteSize: what the topology and the roles compute with
    assert c.model_dump(mode="json")["bus"]["hop_max_bytes"] == 512 << 20
    prompts = next(s for s in build_topology(c).streams if s.key == "prompts")
    assert type(prompts.max_bytes) is int and prompts.max_bytes == 512 << 20  # what the server is given
    assert parse_config({"run": "r1", "bus": {"weights_max_bytes": "1.5 GiB"}}).bus.weights_max_bytes == 3 << 29
    with pytest.raises(ConfigError) as info:
        parse_config({"run": "r1", "bus": {"hop_max_bytes": "1KiB", "dlq_max_bytes": "lots", "max_msg_bytes": "1 KB"}})
    problems = "\n".join(info.value.problems)
    assert "bus.hop_max_bytes: Input should be greater than or equal to 1048576 (got '1KiB')" in problems
    assert "bus.dlq_max_bytes: could not parse value and unit from byte string (got 'lots')" in problems
    assert "bus.max_msg_bytes: Input should be greater than or equal to 1024 (got '1 KB')" in problems

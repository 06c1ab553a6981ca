"""`section.key=value` overrides: the parser and deep merge (unit), and `relax config show / init / run` with them."""

import argparse
import json
from collections.abc import Iterator

import pytest

from relax_bus.errors import ConfigError
from relax_bus.overrides import apply_overrides, parse_overrides, parse_value
from tests.cli.test_cli import assert_one_line_error, relax, write_config
from workers.cli import _parser

BASE = "run: ovr\ngroups_per_step: 4\nrollout: {engine: torch, max_new_tokens: 8}\ntrainer: {steps: 5}\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-4", 1e-4),
        ("-2.5E3", -2500.0),
        ("3", 3),
        ("vllm", "vllm"),
        ("'7'", "7"),
        ("'1e-4'", "1e-4"),
        ("null", None),
        ("true", True),
        ("", ""),
        ("[a, 2]", ["a", 2]),
        ("[{type: exact}, {type: format, weight: 0.5}]", [{"type": "exact"}, {"type": "format", "weight": 0.5}]),
        ("{max_staleness: unbounded}", {"max_staleness": "unbounded"}),
        ("a=b", "a=b"),
    ],
)
def test_values_are_yaml_with_yaml_1_2_floats(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


@pytest.mark.unit
def test_parse_overrides_maps_dotted_keys_and_lists_every_malformed_one():
    assert parse_overrides(["trainer.optim.lr=1e-4", "rewards.0.weight=2", "run=x", "run=y"]) == {
        "trainer.optim.lr": 1e-4,
        "rewards.0.weight": 2,
        "run": "y",  # the last one wins
    }
    with pytest.raises(ConfigError) as info:
        parse_overrides(["trainer.optim.lr", "=3", "a..b=1", "x=[unclosed", "ok=1"])
    assert info.value.source == "command-line overrides"
    assert len(info.value.problems) == 4
    first, empty, dots, yaml_error = info.value.problems
    assert "'trainer.optim.lr': expected section.key=value" in first
    assert "'' is not a dotted key" in empty and "'a..b' is not a dotted key" in dots
    assert yaml_error.startswith("x: not a YAML value")


@pytest.mark.unit
def test_apply_overrides_sets_deep_keys_without_touching_the_input():
    data = {"trainer": {"steps": 5, "warmup": {"max_steps": 3}}, "rollout": {"engine": "torch"}, "rewards": [{"a": 1}]}
    out = apply_overrides(
        data,
        {
            "trainer.warmup.max_steps": 0,
            "trainer.optim.lr": 1e-4,
            "rollout.engine.max_model_len": 512,  # `engine: torch` is the `type` shorthand
            "rewards.0.weight": 2,
            "weights.type": "filesystem",  # a section the file does not have
        },
    )
    assert out["trainer"] == {"steps": 5, "warmup": {"max_steps": 0}, "optim": {"lr": 1e-4}}
    assert out["rollout"] == {"engine": {"type": "torch", "max_model_len": 512}}
    assert out["rewards"] == [{"a": 1, "weight": 2}]
    assert out["weights"] == {"type": "filesystem"}
    assert data["trainer"]["warmup"]["max_steps"] == 3 and data["rollout"]["engine"] == "torch"


@pytest.mark.unit
def test_apply_overrides_names_paths_that_cannot_be_set():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"trainer": {"steps": 5}, "rewards": []}, {"trainer.steps.x": 1, "rewards.0.weight": 2})
    assert info.value.problems == [
        "trainer.steps.x: the value there is 5, which has no keys",
        "rewards.0.weight: '0' is not an index of the 0 element(s) there",
    ]


@pytest.mark.cli
def test_config_show_applies_typed_deep_overrides(tmp_path):
    cfg = write_config(tmp_path, BASE)
    out = relax(
        "config",
        "show",
        cfg,
        "trainer.optim.lr=1e-4",
        "rollout.engine.type=vllm",
        "rewards=[{type: exact}, {type: numeric, weight: 0.5}]",
        "--json",
        "staleness.max_staleness=unbounded",  # after a flag too
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["trainer"]["optim"]["lr"] == 1e-4 and shown["trainer"]["steps"] == 5
    assert shown["rollout"]["engine"]["type"] == "vllm" and shown["rollout"]["max_new_tokens"] == 8
    assert [r["type"] for r in shown["rewards"]] == ["exact", "numeric"] and shown["rewards"][1]["weight"] == 0.5
    assert shown["staleness"]["max_staleness"] is None


@pytest.mark.cli
def test_bad_overrides_are_listed_with_the_files_problems(tmp_path):
    cfg = write_config(tmp_path, BASE + "bogus_top: 1\n")
    out = relax("config", "show", cfg, "trainer.lrr=1", "trainer.steps=-3", "rollout.engine.type=tensorrt")
    assert_one_line_error(
        out,
        f"invalid config {cfg} with command-line overrides (4 problem(s))",
        "  - bogus_top: unknown setting",
        "  - trainer.lrr: unknown setting",
        "  - trainer.steps: Input should be greater than or equal to 1 (got -3)",
        "  - rollout.engine: unknown type 'tensorrt'",
    )


@pytest.mark.cli
def test_a_malformed_override_is_a_one_line_error(tmp_path):
    out = relax("config", "show", write_config(tmp_path, BASE), "trainer.optim.lr")
    assert_one_line_error(
        out, "invalid config command-line overrides", "'trainer.optim.lr': expected section.key=value"
    )
    flag = relax("config", "show", write_config(tmp_path, BASE), "--json", "--bogus-flag")
    assert flag.returncode == 2 and "unrecognized arguments: --bogus-flag" in flag.stderr


@pytest.mark.cli
def test_run_takes_overrides_and_its_flags_are_overrides_that_win(tmp_path):
    cfg = write_config(tmp_path, BASE)
    # Both fail validation before anything starts: the flag's value is the one reported.
    out = relax("run", cfg, "trainer.steps=3", "--steps", "-1", "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(out, "trainer.steps: Input should be greater than or equal to 1 (got -1)")
    out = relax("run", cfg, "--run-id", "bad id!", "trainer.lrr=1", "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(out, "run: String should match pattern", "trainer.lrr: unknown setting")
    assert not (tmp_path / "r").exists()


@pytest.mark.cli
def test_an_abbreviated_flag_is_refused_not_expanded(tmp_path):
    cfg = write_config(tmp_path, BASE)
    out = relax("run", cfg, "--run-dir", str(tmp_path / "r"), "--step", "3")  # not `--steps 3`
    assert out.returncode == 2, out
    assert out.stderr.splitlines()[-1] == "relax: error: unrecognized arguments: --step 3", out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and the parsers of its subcommands at every depth, by their `prog`."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.unit
def test_no_level_of_the_relax_command_takes_an_abbreviated_flag():
    parsers = dict(_parsers(_parser()))
    assert {"relax run", "relax config show", "relax env serve", "relax model import-gguf"} <= set(parsers)
    assert [prog for prog, p in parsers.items() if p.allow_abbrev] == []
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["export", "r1", "--ou", "d"])
    assert exit_.value.code == 2


@pytest.mark.cli
def test_init_provisions_the_overridden_config(nats_server, tmp_path):
    cfg = write_config(tmp_path, BASE)
    first = relax("init", cfg, "run=ovr2", "groups_per_step=6", "--nats-url", nats_server.url, "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["run"] == "ovr2"
    shown = relax("inspect", "ovr2", "--nats-url", nats_server.url, "--json")
    assert shown.returncode == 0, shown.stderr
    stored = json.loads(shown.stdout)["config"]
    assert stored["groups_per_step"] == 6 and stored["trainer"]["steps"] == 5

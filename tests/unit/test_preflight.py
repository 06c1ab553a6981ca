"""The pre-start check: each role runs the checks its registry entry names, every problem is listed in one
error, and the exit code of each kind of error says whether running again can help."""

from __future__ import annotations

import pytest

from relax_bus.errors import (
    EXIT_REFUSED,
    EXIT_TEMPORARY,
    ConfigError,
    NatsRefused,
    NatsUnavailable,
    NatsUnreachable,
    PublishFailed,
    StreamFull,
)
from workers.config import parse_config
from workers.errors import RoleNotInRun, RoleRefused
from workers.preflight import CHECKS, preflight
from workers.role_registry import ROLES, role_def

pytestmark = pytest.mark.unit


def test_every_role_names_known_checks_and_the_parts_it_uses():
    for entry in ROLES:
        assert set(entry.checks) <= CHECKS.keys(), entry.name
    assert role_def("feeder").checks == ("task",)
    assert {"model", "engine"} <= set(role_def("rollout").checks)
    assert "rewards" in role_def("reward").checks
    assert "model" in role_def("reference").checks and "model" in role_def("actor").checks
    assert role_def("metrics").checks == ()


def test_a_role_checks_only_its_parts(tmp_path):
    """The feeder checks the task, not the model (it never loads one): only the dataset is reported."""
    config = parse_config(
        {"run": "pf", "model": {"source": str(tmp_path / "gone")}, "task": {"type": "jsonl", "options": {"path": "/x"}}}
    )
    with pytest.raises(ConfigError) as err:
        preflight(config, tmp_path, role_def("feeder").checks, "run pf (feeder)")
    assert err.value.source == "run pf (feeder)"
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith("task: jsonl task file '/x'")
    preflight(config, tmp_path, role_def("metrics").checks)  # nothing to check
    with pytest.raises(ValueError, match="unknown pre-start checks"):
        preflight(config, tmp_path, ("modle",))


def test_exit_codes_say_whether_another_attempt_can_help():
    refused = [ConfigError("x", ["y"]), NatsRefused("bad password"), RoleNotInRun("no"), RoleRefused("r")]
    assert {e.exit_code for e in refused} == {EXIT_REFUSED} == {2}
    temporary = [NatsUnreachable("down"), NatsUnavailable("gone"), PublishFailed("lost"), StreamFull("full")]
    assert {e.exit_code for e in temporary} == {EXIT_TEMPORARY} == {75}


def test_a_module_the_config_needs_and_this_machine_lacks_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """An `hf` task without datasets and a `math` reward without math-verify (an image without the `models`
    extra): refused before anything runs, each with the extra to install, instead of a traceback and a run whose
    every sample scores 0."""
    import importlib.util
    import sys

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    config = parse_config(
        {
            "run": "pf",
            "task": {"type": "hf", "options": {"path": str(data)}},
            "rewards": [{"type": "math"}],
        }
    )
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ModuleNotFoundError
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        preflight(config, tmp_path, ("task", "rewards"))
    assert err.value.problems == [
        "task: the Python module 'datasets' is not installed: install the `models` extra "
        "(pip install 'relax-bus[models]'; the image has it)",
        "rewards: the Python module 'math_verify' is not installed: install the `models` extra "
        "(pip install 'relax-bus[models]'; the image has it)",
    ]
    monkeypatch.undo()
    preflight(config, tmp_path, ("task", "rewards"))  # both installed here: the same config passes

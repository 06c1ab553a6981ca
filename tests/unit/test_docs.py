"""The docs match the code: the configuration reference is generated, every config key the prose names
exists, and every example config is valid."""

import re
from pathlib import Path

import pytest

from workers import state_keys
from workers.config import load_config
from workers.config_reference import render

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = ("staleness", "bus", "model", "task", "rewards", "rollout", "trainer", "weights", "roles")
STATE_KEYS = {v for k, v in vars(state_keys).items() if k.isupper() and isinstance(v, str)}


def reference_keys() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", render(), flags=re.M))


def test_configuration_reference_is_generated_from_the_models():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), (
        "docs/configuration.md is stale: python -m workers.config_reference > docs/configuration.md"
    )


def named_keys(text: str) -> set[str]:
    """Dotted config keys written in backticks (`trainer.kl.coef`, `bus.*`), first segment a section."""
    found = set()
    for token in re.findall(r"`([a-z_]+(?:\.[a-z_*]+)+)(?:[:=][^`]*)?`", text):
        if token.split(".")[0] in SECTIONS and token not in STATE_KEYS:
            found.add(token)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_key_the_docs_name_exists(page):
    known = reference_keys()
    missing = []
    for key in sorted(named_keys(page.read_text())):
        ok = any(k.startswith(key[:-1]) for k in known) if key.endswith(".*") else key in known
        if not ok:
            missing.append(key)
    assert not missing, f"{page.name} names config keys that do not exist: {missing}"


def test_the_key_check_would_catch_a_wrong_key():
    assert named_keys("set `trainer.kl_coeff` and `trainer.done`, see `relax_bus.chain`") == {"trainer.kl_coeff"}
    assert "trainer.kl_coeff" not in reference_keys() and "trainer.kl.coef" in reference_keys()


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(example):
    config = load_config(example)
    assert config.chain, example

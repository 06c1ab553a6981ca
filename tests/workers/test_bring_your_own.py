"""Hub ids of models and datasets from a hub cache laid out by hand (offline), and rewards that take the prompt,
the item's columns, or a whole group at once."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from relax_bus.errors import ConfigError
from tests.hub_cache import COMMIT, cache_repo
from workers.config import parse_config
from workers.config.hub import HubSettings
from workers.data.models import load_model, load_tokenizer, materialize
from workers.data.tasks import load_task
from workers.preflight import preflight
from workers.rewards.scorer import Scorer

FNS = "tests.workers.reward_fns"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline, as this process's hub settings."""
    cache = tmp_path / "hub"
    offline = HubSettings(hf_hub_offline=True, hf_hub_cache=cache)
    monkeypatch.setattr("workers.data.hub_snapshot.hub_settings", lambda: offline)
    return cache


def test_a_bare_hub_id_and_a_pinned_revision_load_from_the_cached_snapshot(hub: Path, tmp_path: Path) -> None:
    built = materialize("tiny:64x1", tmp_path / "built", seed=3)
    snap = cache_repo(hub, "acme/tiny-chat", built)
    assert materialize("acme/tiny-chat", tmp_path / "unused") == snap
    assert materialize(f"hf:acme/tiny-chat@{COMMIT}", tmp_path / "unused") == snap
    assert not (tmp_path / "unused").exists()  # the snapshot is the directory: nothing is copied per role
    model, tokenizer = load_model(snap), load_tokenizer(snap)
    assert model.config.hidden_size == 64 and len(tokenizer) == model.config.vocab_size
    config = parse_config({"run": "r", "model": {"source": {"type": "hf", "id": "acme/tiny-chat"}}})
    preflight(config, tmp_path / "work", ("model",))  # found in the cache: nothing to report


def test_a_model_missing_from_the_cache_is_one_line_naming_it(hub: Path, tmp_path: Path) -> None:
    cache_repo(hub, "acme/tiny-chat", materialize("tiny:64x1", tmp_path / "built"))
    for source, name in (("hf:acme/tiny-chat@v2", "hf:acme/tiny-chat@v2"), ("acme/other", "hf:acme/other@main")):
        with pytest.raises(ConfigError) as err:
            preflight(parse_config({"run": "r", "model": {"source": source}}), tmp_path / "work", ("model",))
        (problem,) = err.value.problems
        assert problem == f"model.source: {name} is not in the Hugging Face cache {hub} (HF_HUB_OFFLINE is set)"


def test_a_hub_dataset_id_reads_its_snapshot_with_field_mapping_and_columns(hub: Path, tmp_path: Path) -> None:
    files = tmp_path / "files" / "data"
    files.mkdir(parents=True)
    rows = {"question": ["2+2?", "3+5?"], "solution": ["#### 4", "#### 8"], "level": [1, 3], "tags": [["a"], ["b"]]}
    pd.DataFrame(rows).to_parquet(files / "train-00000-of-00001.parquet")
    cache_repo(hub, "acme/sums", files.parent, repo_type="dataset")
    spec = {"path": "acme/sums", "prompt_field": "question", "answer_field": "solution", "answer_regex": r"####\s*(.+)"}
    items = load_task({"type": "hf", **spec})
    assert [(i.parts[0].text, i.answer, dict(i.columns)) for i in items] == [
        ("2+2?", "4", {"level": 1}),  # a list column is not carried
        ("3+5?", "8", {"level": 3}),
    ]
    assert [dict(i.columns) for i in load_task({"type": "hf", **spec, "columns": ["level"], "seed": 1})] in (
        [{"level": 1}, {"level": 3}],
        [{"level": 3}, {"level": 1}],
    )
    with pytest.raises(ValueError, match=r"row 0: no column 'grade'"):
        load_task({"type": "hf", **spec, "columns": ["grade"]})
    local = load_task({"type": "hf", **spec, "path": str(files.parent)})  # a local directory of parquet files
    assert [i.answer for i in local] == ["4", "8"]
    with pytest.raises(ValueError, match=r"^dataset acme/none@main is not in the Hugging Face cache"):
        load_task({"type": "hf", **spec, "path": "acme/none"})


def test_a_per_sample_reward_gets_the_prompt_and_the_columns_it_declares() -> None:
    with Scorer([{"type": "python", "options": {"function": f"{FNS}:with_prompt"}}]) as scorer:
        assert scorer.score("cat", None, "stop", "say cat", {"difficulty": 3, "other": "x"}).reward == 3.0
        assert scorer.score("dog", None, "stop", "say cat", {"difficulty": 3}).reward == 0.0
        assert scorer.score("cat", None, "stop", "say cat", {}).error == (
            "TypeError: with_prompt() missing 1 required positional argument: 'difficulty'"
        )
    with Scorer([{"type": "python", "options": {"function": f"{FNS}:good"}}]) as scorer:  # declares neither
        assert scorer.score("4", "4", "stop", "2+2=", {"difficulty": 3}).reward == 1.0


def test_a_batched_reward_is_called_once_per_group_with_lists() -> None:
    spec = {"type": "python", "batched": True, "options": {"function": f"{FNS}:batch_length"}}
    with Scorer([spec, {"type": "exact"}]) as scorer:
        scores = scorer.score_many(["ab", "abcd", "x"], "x", ["stop", "stop", "length"], "p", {"scale": 2})
    assert [s.reward for s in scores] == [1.0, 2.0, 0.5]
    assert scores[2].components == {"batch_length": 0.5, "exact": 0.0}


@pytest.mark.parametrize(
    ("function", "timeout_s", "error"),
    [
        ("batch_short", 5.0, "ValueError: batched reward function returned 2 values for 3 completions"),
        ("batch_hangs", 1.0, "timed out after 1s"),
    ],
)
def test_a_failed_batch_is_every_samples_error_never_a_zero(function: str, timeout_s: float, error: str) -> None:
    spec = {"type": "python", "batched": True, "timeout_s": timeout_s, "options": {"function": f"{FNS}:{function}"}}
    with Scorer([spec]) as scorer:
        scores = scorer.score_many(["a", "b", "c"], None, ["stop"] * 3)
    assert [(s.reward, s.error) for s in scores] == [(0.0, error)] * 3


def test_a_reward_named_by_file_path_runs_in_the_sandbox(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(
        "def score(completions, prompts, answers, level):\n"
        "    return [float(c == a) * lv for c, a, lv in zip(completions, answers, level)]\n"
    )
    spec = {"type": "python", "batched": True, "options": {"function": f"{tmp_path}/my_reward.py:score"}}
    with Scorer([spec]) as scorer:
        assert [s.reward for s in scorer.score_many(["4", "5"], "4", ["stop"] * 2, "2+2=", {"level": 2})] == [2.0, 0.0]

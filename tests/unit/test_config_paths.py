"""Paths in a config file are read from its directory; the config stored for the roles holds them absolute."""

from __future__ import annotations

from pathlib import Path

import yaml

from workers.config import DirSource, HfSource, load_config, parse_config

CONFIG = {
    "run": "paths",
    "model": {"source": "models/mine"},
    "task": {"type": "hf", "options": {"path": "data/train.parquet"}},
    "rewards": [{"type": "python", "options": {"function": "rewards/score.py:score"}}],
    "trainer": {"sft": {"dataset": "data/sft.jsonl"}, "checkpoint": {"dir": "/abs/ckpt"}},
    "metrics": {"out_dir": "~/metrics"},
}


def write(where: Path, data: dict) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "models" / "mine").mkdir(parents=True, exist_ok=True)
    (where / "data").mkdir(exist_ok=True)
    (where / "data" / "train.parquet").touch()
    path = where / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_paths_are_read_from_the_config_files_directory(tmp_path: Path, monkeypatch) -> None:
    config_file = write(tmp_path / "project", CONFIG)
    monkeypatch.chdir(tmp_path)  # elsewhere: the working directory plays no part
    config = load_config("project/run.yaml")
    base = tmp_path / "project"
    assert config.model.source == DirSource(type="dir", path=str(base / "models" / "mine"))
    assert config.task.options.path == str(base / "data" / "train.parquet")
    assert config.rewards[0].options.function == f"{base}/rewards/score.py:score"
    assert config.trainer.sft is not None and config.trainer.sft.dataset == str(base / "data" / "sft.jsonl")
    assert config.trainer.checkpoint.dir == "/abs/ckpt"  # absolute: as it is
    assert config.metrics.out_dir == "~/metrics"  # the home directory: as it is
    # What `relax init` stores and every role validates again: the same absolute paths, wherever it runs.
    again = parse_config(config.model_dump(mode="json"))
    assert again.task.options.path == config.task.options.path and again.model.source == config.model.source
    assert load_config(config_file, {"task.options.path": "data/other.parquet"}).task.options.path == str(
        base / "data" / "other.parquet"
    )


def test_a_bare_org_name_is_a_hub_id_unless_that_directory_is_there(tmp_path: Path) -> None:
    data = {**CONFIG, "model": {"source": "acme/tiny-chat"}, "task": {"type": "hf", "options": {"path": "acme/sums"}}}
    config = load_config(write(tmp_path, data))
    assert config.model.source == HfSource(type="hf", id="acme/tiny-chat")
    assert config.task.options.path == "acme/sums"  # nothing of that name there: a hub dataset id
    (tmp_path / "acme" / "tiny-chat").mkdir(parents=True)
    (tmp_path / "acme" / "sums").mkdir(parents=True)
    config = load_config(tmp_path / "run.yaml")
    assert config.model.source == DirSource(type="dir", path=str(tmp_path / "acme" / "tiny-chat"))
    assert config.task.options.path == str(tmp_path / "acme" / "sums")
    cached = load_config(
        write(tmp_path, {**data, "model": {"source": {"type": "hf", "id": "a/b", "cache_dir": "hub"}}})
    )
    assert cached.model.source.cache_dir == str(tmp_path / "hub")


def test_a_mapping_without_a_file_keeps_relative_paths() -> None:
    config = parse_config({"run": "r", "task": {"type": "jsonl", "options": {"path": "data/x.jsonl"}}})
    assert config.task.options.path == "data/x.jsonl"
    assert parse_config({"run": "r", "model": {"source": "./models/m"}}).model.source.path == "./models/m"

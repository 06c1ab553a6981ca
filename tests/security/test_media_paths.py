"""Finding 7: a JSONL media `path` and a `file://` media reference read any file the process could open (`/dev/zero`
filled memory, `../../etc/passwd` left the dataset). Now a local media file is read only inside the run's media root
(the jsonl task's directory, or its `media_root`), only if it is a regular file once every symlink is followed; at
load (`path`) and by the workers (`file://` in a delivered prompt) alike, refused with one line."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from relax_bus.stub import StubBus
from relax_bus.worker import Worker, WorkerOptions
from schemas import ImagePart, MediaRef, PromptGroup, TextPart
from tests import factories as f
from workers.config import parse_config
from workers.data.jsonl_task import jsonl, task_media_root
from workers.engines.sim_engine import SimEngine
from workers.omni.errors import MediaError
from workers.omni.media_refs import PayloadCache
from workers.roles.rollout import Rollout

pytestmark = pytest.mark.unit
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A dataset directory holding one image, beside a secret outside it and a symlink out of it."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"the admin password")
    (root / "out.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(root / "pipe.png")
    return root


def lines(root: Path, *paths: str) -> Path:
    file = root / "tasks.jsonl"
    rows = [
        {"prompt": [{"type": "image", "path": p, "mime": "image/png"}, {"type": "text", "text": "?"}]} for p in paths
    ]
    file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return file


def test_a_path_inside_the_dataset_directory_is_read(dataset):
    (item,) = jsonl(lines(dataset, "ok.png"))
    assert item.parts[0].inline == PNG


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/dev/zero", "is outside"),
        ("../secret.png", "is outside"),
        ("../../../../../../etc/passwd", "is outside"),
        ("out.png", "is outside"),  # a symlink out of the root
        ("pipe.png", "is not a regular file"),  # would block a plain read
        ("missing.png", "cannot be read"),
    ],
)
def test_a_path_out_of_the_dataset_or_not_a_regular_file_is_refused_at_load(dataset, path, why):
    with pytest.raises(ValueError, match=why) as refused:
        jsonl(lines(dataset, path))
    assert "line 1" in str(refused.value) and "Traceback" not in str(refused.value)


def test_an_explicit_media_root_is_the_only_directory_read(dataset, tmp_path):
    (item,) = jsonl(lines(dataset, "../secret.png"), media_root=tmp_path)
    assert item.parts[0].inline == b"the admin password"  # what the config allows, explicitly
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ValueError, match="is outside"):
        jsonl(lines(dataset, "ok.png"), media_root=tmp_path / "elsewhere")


async def test_a_file_reference_is_read_only_inside_the_root(dataset, tmp_path):
    cache = PayloadCache(StubBus.of(parse_config({"run": "r"})).media, root=dataset)
    ok = (ImagePart(mime="image/png", ref=MediaRef(uri=f"file://{dataset / 'ok.png'}")),)
    assert list((await cache.payloads(ok)).values()) == [PNG]
    for uri in ("file:///dev/zero", f"file://{dataset}/../secret.png", f"file://{dataset / 'out.png'}", "/etc/passwd"):
        with pytest.raises(MediaError, match="is outside"):
            await cache.payloads((ImagePart(mime="image/png", ref=MediaRef(uri=uri)),))
    unrooted = PayloadCache(cache.store)  # a run without a jsonl task reads no local file at all
    with pytest.raises(MediaError, match="reads no local media file"):
        await unrooted.payloads(ok)


async def test_a_delivered_prompt_referencing_a_file_out_of_the_root_is_dead_lettered(dataset, tmp_path):
    """A prompt as the feeder's credentials could publish it, naming files outside the dataset: the rollout
    dead-letters it with the reason and reads nothing."""
    tasks = lines(dataset, "ok.png")
    config = parse_config(
        {"run": f"t{uuid.uuid4().hex[:8]}", "task": {"type": "jsonl", "options": {"path": str(tasks)}}}
    )
    assert task_media_root(config.task) == dataset
    bus = StubBus.of(config)
    rollout = Rollout(bus, SimEngine(tmp_path), None, None, "w")  # type: ignore[arg-type]
    worker = Worker(bus, "rollout", rollout.handle, PromptGroup, WorkerOptions())
    for uri in (f"file://{dataset}/../secret.png", f"file://{dataset / 'out.png'}", "file:///etc/passwd"):
        parts = (ImagePart(mime="image/png", ref=MediaRef(uri=uri)), TextPart(text="?"))
        handled = await bus.deliver(worker, f.prompt(bus.run, 0).model_copy(update={"parts": parts}))
        assert handled.outcome == "dead_letter", handled
        assert handled.reason is not None and "is outside" in handled.reason, handled.reason

"""On-policy distillation end to end: every role a process on a real nats-server, the teacher role between the
reference role and the actor (reward -> scored -> reference -> teach -> teacher -> train), the teacher SIGKILLed
after a step and started again. Every released group is trained exactly once, every trained group carries the
teacher's log-probs of its sampled tokens (equal to a teacher-forced forward of the teacher), and every step reports
the reverse KL."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.e2e.cluster import Cluster, role_events, small_config
from tests.e2e.test_pipeline import run
from workers.config import parse_config
from workers.data.models import load_model, load_tokenizer, materialize
from workers.training.batch import make_batch
from workers.training.logprobs import token_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def sharp_teacher(root) -> str:
    """A teacher unlike the student: another seed's tiny model with its logits scaled by 4."""
    source = materialize("tiny:64x2", root / "teacher-src", seed=11)
    model = load_model(source)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    out = root / "teacher"
    model.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return str(out)


async def test_a_distilling_run_with_a_reference_trains_every_group_once_on_the_teachers_log_probs(
    nats_server, tmp_path
):
    teacher_dir = sharp_teacher(tmp_path)
    config = parse_config(
        small_config(
            f"distill{uuid.uuid4().hex[:8]}",
            trainer={"steps": 6, "kl": {"coef": 0.01}},
            teacher={"source": teacher_dir, "coef": 1.0, "reward_coef": 0.5},
        )
    )
    assert [r.name for r in config.chain][2:5] == ["reward", "reference", "teacher"]

    async def crash_the_teacher(cluster: Cluster) -> None:
        await cluster.wait_step(2)
        cluster.kill("teacher")
        cluster.restart("teacher")

    cluster = await run(nats_server, tmp_path, config, crash_the_teacher)
    try:
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert len(role_events(cluster.role("teacher"), "teacher_ready")) == 2  # the first teacher and its successor
        kls = [m.values.get("distill_reverse_kl") for m in acc.metrics]
        assert len(kls) == config.trainer.steps and all(k is not None and k > 0 for k in kls), kls
        trained = set(acc.trained)
        groups = [g for g in acc.train_groups if g.group_id in trained]
        assert {g.group_id for g in groups} == trained
        assert all(g.teacher_logprobs is not None and g.ref_logprobs is not None for g in groups)
        teacher = load_model(teacher_dir)
        for group in groups[:4]:
            batch = make_batch([group])
            with torch.no_grad():
                forced = token_logprobs(teacher, batch.ids, batch.attention, config.rollout.temperature)
            valid = batch.mask.bool()
            assert batch.teacher_logp is not None
            gap = float((batch.teacher_logp[valid] - forced[valid]).abs().max())
            assert gap < 1e-4, gap
        print(f"reverse KL by step: {[round(k or 0.0, 3) for k in kls]}")
    finally:
        await cluster.stop()

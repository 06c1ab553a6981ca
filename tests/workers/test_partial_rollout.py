"""Partial rollouts: chunked generation, a newer version taken between chunks (continue, restart), the version of
every token, and fencing (a version whose weights failed to load never labels a token)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from relax_bus.errors import BlobNotFound, ConfigError
from schemas import RolloutGroup, ScoredGroup, TrainGroup, WireTensor
from tests import factories as f
from workers.config import parse_config
from workers.engines.base import Generated, SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.roles.partial import Partial, generate_partial, labelled, spans_of
from workers.roles.rollout import Rollout, sample_of
from workers.training.logprobs import token_logprobs
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers
SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=8)


def prompts_of(engine: TorchEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in ("1+2=", "12+30=")]


def moved(engine: TorchEngine, seed: int) -> dict[str, torch.Tensor]:
    """Every weight + 20 % relative noise: the next policy version."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + torch.randn(v.shape, generator=gen) * (v.std() if v.numel() > 1 else 0) * 0.2
        for k, v in engine.model.state_dict().items()
    }


def loader(engine: TorchEngine, versions: list[dict[str, torch.Tensor]]):
    """A refresh that loads the next of `versions` after each chunk (as a new version published mid-generation)."""
    pending = list(versions)

    async def refresh() -> bool:
        if not pending:
            return False
        engine.load_state_dict(pending.pop(0), engine.version + 1)
        return True

    return refresh


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1 :]


def test_spans_are_run_lengths():
    assert spans_of([3, 3, 4, 4, 4, 6]) == ((3, 2), (4, 3), (6, 1))
    assert spans_of([]) == ()


async def test_one_chunk_samples_what_the_plain_call_samples(model_dir, one_torch_thread):
    engine = TorchEngine(model_dir)
    prompts, seeds = prompts_of(engine), [11, 97]
    plain = engine.generate(prompts, 3, SAMPLING, seeds)

    async def never() -> bool:
        return False

    chunked = await generate_partial(engine, prompts, 3, SAMPLING, seeds, 8, "continue", never)
    for a, b in zip(plain, chunked, strict=True):
        assert [g.token_ids for g in a] == [p.generated.token_ids for p in b]
        assert all(p.spans == ((0, len(p.generated.token_ids)),) for p in b)


async def test_continue_labels_each_token_with_the_weights_that_sampled_it(model_dir, one_torch_thread):
    engine = TorchEngine(model_dir)
    engine.version = 0
    prompts = prompts_of(engine)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items()}
    v1 = moved(engine, 1)
    never_stop = SamplingSettings(temperature=1.0, max_new_tokens=8)
    engine.eos_ids = torch.tensor([-1])  # no row ends early: every row crosses the boundary
    out = await generate_partial(engine, prompts, 2, never_stop, [5, 6], 3, "continue", loader(engine, [v1]))
    reference = TorchEngine(model_dir)
    for prompt, samples in zip(prompts, out, strict=True):
        for p in samples:
            assert p.versions == [0, 0, 0, 1, 1, 1, 1, 1]
            assert p.spans == ((0, 3), (1, 5))
            got = torch.tensor(p.generated.logprobs)
            reference.model.load_state_dict(v0)
            before = teacher_forced(reference.model, prompt, p.generated.token_ids)
            reference.model.load_state_dict(v1)
            after = teacher_forced(reference.model, prompt, p.generated.token_ids)
            assert torch.allclose(got[:3], before[:3], atol=1e-4), (got, before)
            assert torch.allclose(got[3:], after[3:], atol=1e-4), (got, after)
            assert not torch.allclose(before[3:], after[3:], atol=1e-3)  # the versions really differ


async def test_restart_starts_the_group_over_once(model_dir, one_torch_thread):
    engine = TorchEngine(model_dir)
    engine.version = 0
    engine.eos_ids = torch.tensor([-1])
    out = await generate_partial(
        engine,
        prompts_of(engine),
        2,
        SAMPLING,
        [5, 6],
        3,
        "restart",
        loader(engine, [moved(engine, 1), moved(engine, 2)]),
    )
    for samples in out:
        for p in samples:
            # restarted under v1 after the first chunk; v2 arrives after the next one and is continued under
            assert p.versions == [1, 1, 1, 2, 2, 2, 2, 2]


async def test_a_version_that_failed_to_load_never_labels_a_token(model_dir, one_torch_thread):
    engine = TorchEngine(model_dir)
    engine.version = 0
    engine.eos_ids = torch.tensor([-1])

    class Tracker:
        value = 1  # v1 is announced ...

        async def refresh(self) -> None:
            return None

        async def wait_for(self, version: int) -> int:
            return self.value

    class Transport:
        async def read(self, version: int) -> dict[str, torch.Tensor]:
            raise BlobNotFound(f"weights/v{version} is gone")  # ... but its weights cannot be read

    rollout = Rollout.__new__(Rollout)
    rollout.engine, rollout.tracker, rollout.transport, rollout.worker = engine, Tracker(), Transport(), None
    rollout.bus = SimpleNamespace(config=SimpleNamespace(staleness=SimpleNamespace(max_staleness=2)))
    out = await generate_partial(engine, prompts_of(engine), 2, SAMPLING, [5, 6], 3, "continue", rollout._refresh)
    assert engine.version == 0
    assert all(p.versions == [0] * 8 for samples in out for p in samples)


def test_spans_must_cover_the_response_and_the_group_takes_the_oldest():
    r = f.rollout(f.prompt("r1"), version=3)
    s = r.samples[0]
    assert sample_of_spans(s, ((3, 1), (4, 1))).version_spans == ((3, 1), (4, 1))
    with pytest.raises(ValidationError, match="cover 3 tokens"):
        sample_of_spans(s, ((3, 1), (4, 2)))
    with pytest.raises(ValidationError, match="not the oldest version"):
        type(r)(**{**dict(r), "policy_version": 4, "samples": (sample_of_spans(s, ((3, 1), (4, 1))),)})


def sample_of_spans(s, spans):
    return type(s)(**{**dict(s), "version_spans": spans})


def test_a_group_is_labelled_by_its_oldest_token_and_only_other_versions_are_spelled_out():
    def partial(*versions: int) -> Partial:
        tokens = list(range(len(versions)))
        return Partial(Generated(tokens, [0.0] * len(tokens), "", "length"), list(versions))

    # restarted under v1: every token is v1, so the group is v1 (not the version the call started with)
    assert labelled([partial(1, 1, 1), partial(1, 1, 2)]) == (1, [(), ((1, 2), (2, 1))])
    assert labelled([partial(3, 3), partial(3)]) == (3, [(), ()])
    # a sample wholly of a newer version than the group's says so
    assert labelled([partial(0, 1), partial(1, 1)]) == (0, [((0, 1), (1, 1)), ((1, 2),)])


def test_r3_with_partial_rollouts_is_refused():
    with pytest.raises(ConfigError, match="routing spans are not recorded"):
        parse_config({"run": "t", "rollout": {"partial": "continue"}, "trainer": {"moe": {"routing_replay": "r3"}}})


async def test_tokens_older_than_the_bound_are_masked_out_of_the_loss(model_dir, one_torch_thread):
    engine = TorchEngine(model_dir)
    engine.version = 0
    engine.eos_ids = torch.tensor([-1])
    prompts = prompts_of(engine)
    out = await generate_partial(
        engine, prompts, 2, SAMPLING, [5, 6], 3, "continue", loader(engine, [moved(engine, 1)])
    )
    groups = []
    for i, (prompt, samples) in enumerate(zip(prompts, out, strict=True)):
        p = f.prompt("t", i, n=2)
        rollout = RolloutGroup(
            prompt=p,
            prompt_token_ids=WireTensor.from_values(prompt, "int32"),
            samples=tuple(sample_of(s.generated, s.spans) for s in samples),
            policy_version=0,
        )
        assert rollout.newest_version == 1  # what mask_stale_tokens judges the group by
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(0.0, 1.0))))
    config = {"run": "t", "model": {"source": str(model_dir)}, "groups_per_step": 2, "samples_per_group": 2}
    masked = PolicyTrainer(
        model_dir, parse_config({**config, "staleness": {"max_staleness": 1, "mask_stale_tokens": True}})
    )
    metrics = masked.step(groups, version=2)  # floor 2 - 1 = 1: the three v0 tokens of each row go
    assert metrics["masked_stale_tokens"] == 3 * 4
    assert metrics["response_tokens"] == 5 * 4  # the tokens left in the loss: the five v1 tokens of each row
    plain = PolicyTrainer(model_dir, parse_config({**config, "staleness": {"max_staleness": 1}}))
    assert "masked_stale_tokens" not in plain.step(groups, version=2)

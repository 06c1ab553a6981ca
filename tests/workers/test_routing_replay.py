"""Routing replay (R3, R2) on the tiny MoE: recording in the engine, replay in the trainer and the reference, the
routing on the wire, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from relax_bus.envelope import CLAIM, open_message
from relax_bus.errors import ConfigError
from schemas import RolloutGroup, TrainGroup, WireTensor, decode, encode
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.data.models import materialize
from workers.engines.base import make_engine
from workers.engines.torch_engine import TorchEngine
from workers.moe.routing import recording, replaying, routers
from workers.roles.reference import replayed_logprobs
from workers.training.batch import make_batch, routed_experts
from workers.training.logprobs import token_logprobs
from workers.training.routing_replay import grouped_plan, plain_plan
from workers.training.trainer import PolicyTrainer

pytestmark = pytest.mark.workers
PROMPTS = ["1+2=", "9+9=", "4+0="]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory):
    return materialize("tiny-moe", tmp_path_factory.mktemp("models") / "moe", seed=0)


def groups_from(engine: TorchEngine, n: int = 4, temperature: float = 1.0) -> list[TrainGroup]:
    return engine_groups(engine, PROMPTS, n, temperature=temperature, max_new_tokens=6, seed=5)


def perturb_routers(model: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Router weights + `scale` relative Gaussian noise: the rollout/trainer routing gap R3 exists for."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * r.weight.std() * scale)


def trainer_for(moe_dir, replay: str, **trainer) -> PolicyTrainer:
    config = parse_config(
        {
            "run": "t",
            "model": {"source": "tiny-moe"},
            "groups_per_step": 3,
            "samples_per_group": 4,
            "trainer": {
                "optim": {"lr": 1e-3},
                **trainer,
                "moe": {"routing_replay": replay, "metrics_fraction": 1.0, **trainer.get("moe", {})},
            },
        }
    )
    return PolicyTrainer(moe_dir, config)


def test_the_engine_records_the_routing_a_teacher_forced_forward_takes(moe_dir, one_torch_thread):
    engine = TorchEngine(moe_dir, record_routing=True)
    groups = groups_from(engine)
    for g in groups:
        prompt = g.scored.rollout.prompt_token_ids.to_values()
        for s in g.scored.rollout.samples:
            routes = routed_experts(s.routed_experts)
            assert routes is not None and routes.dtype == torch.uint8
            assert routes.shape == (len(prompt) + s.token_ids.numel - 1, 2, 2)
            ids = torch.tensor([prompt + s.token_ids.to_values()])
            with torch.no_grad(), recording(engine.model) as rec:
                token_logprobs(engine.model, ids, torch.ones_like(ids))
            free = rec.calls[0][: routes.shape[0]]
            assert torch.equal(free.sort(-1).values, routes.long().sort(-1).values)


@pytest.mark.parametrize("shared", [True, False], ids=["prompt-shared", "plain"])
def test_equal_weights_replayed_logprobs_equal_the_rollouts(moe_dir, one_torch_thread, shared):
    engine = TorchEngine(moe_dir, record_routing=True)
    groups = groups_from(engine)
    trainer = trainer_for(moe_dir, "r3", compute={"shared_prompt": shared})
    metrics = trainer.step(groups)
    assert metrics["routing_agreement"] == 1.0
    assert metrics["routing_mismatch_replay_max"] < 1e-5
    assert metrics["routing_mismatch_free_max"] < 1e-5  # same weights: the router picks the same experts


def test_a_perturbed_router_is_corrected_by_replay(moe_dir, one_torch_thread):
    engine = TorchEngine(moe_dir, record_routing=True)
    perturb_routers(engine.model, 0.5)
    groups = groups_from(engine)
    metrics = trainer_for(moe_dir, "r3").step(groups)
    assert metrics["routing_agreement"] < 1.0
    assert metrics["routing_mismatch_free"] > 1e-4, metrics
    # Only the routers differ: forcing the rollout's experts leaves the score weights' small difference.
    assert metrics["routing_mismatch_replay"] < 0.5 * metrics["routing_mismatch_free"], metrics
    assert metrics["routing_mismatch_replay_max"] < metrics["routing_mismatch_free_max"], metrics


def test_replay_keeps_the_routers_gradient(moe_dir, one_torch_thread):
    engine = TorchEngine(moe_dir, record_routing=True)
    batch = make_batch(groups_from(engine))
    trainer = trainer_for(moe_dir, "r3", compute={"shared_prompt": False})
    plans = trainer.routing._plans(batch, list(range(batch.ids.shape[0])), shared=False)
    with replaying(trainer.model, plans):
        logp = token_logprobs(trainer.model, batch.ids, batch.attention)
    (logp * batch.mask).sum().backward()
    for r in routers(trainer.model):
        assert r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0


def test_r2_replays_the_old_policys_routing_across_updates(moe_dir, one_torch_thread):
    engine = TorchEngine(moe_dir)
    groups = groups_from(engine)
    assert all(s.routed_experts is None for g in groups for s in g.scored.rollout.samples)
    trainer = trainer_for(moe_dir, "r2", mini_batches=3, optim={"lr": 5e-2})
    seen: list[int] = []
    real_forward = trainer.routing.forward

    def spy(*args, **kwargs):
        ctx = real_forward(*args, **kwargs)

        class Watch:
            def __enter__(self):
                self.replayer = ctx.__enter__()
                return self.replayer

            def __exit__(self, *exc):
                if self.replayer is not None:
                    seen.append(self.replayer.replayed_calls)
                return ctx.__exit__(*exc)

        return Watch()

    trainer.routing.forward = spy  # type: ignore[method-assign]
    metrics = trainer.step(groups)
    assert metrics["updates"] == 3.0
    assert len(seen) == 3 and all(f > 0 for f in seen)  # every update forced the recorded routing
    assert "routing_agreement" not in metrics  # routing metrics compare with the rollout: r3 only


def test_the_reference_replays_the_rollouts_routing(moe_dir, one_torch_thread):
    engine = TorchEngine(moe_dir, record_routing=True)
    perturb_routers(engine.model, 0.5)
    group = groups_from(engine)[0]
    reference = make_engine("torch", moe_dir).model  # the initial weights, routers unperturbed
    rollout = group.scored.rollout
    with torch.no_grad():
        forced = replayed_logprobs(reference, rollout, 1.0, replay=True)
        free = replayed_logprobs(reference, rollout, 1.0, replay=False)
    with torch.no_grad():  # the rollout engine's own routing, on its own weights
        exact = replayed_logprobs(engine.model, rollout, 1.0, replay=False)
    gap_forced = sum(float((a - b).abs().sum()) for a, b in zip(forced, exact, strict=True))
    gap_free = sum(float((a - b).abs().sum()) for a, b in zip(free, exact, strict=True))
    assert gap_forced < gap_free


def test_routing_survives_encode_and_decode(moe_dir, one_torch_thread):
    group = groups_from(TorchEngine(moe_dir, record_routing=True))[0]
    back = decode(encode(group))
    assert isinstance(back, TrainGroup)
    for a, b in zip(group.scored.rollout.samples, back.scored.rollout.samples, strict=True):
        assert a.routed_experts == b.routed_experts and b.routed_experts is not None


def test_routing_of_the_wrong_length_is_refused_by_the_schema(moe_dir, one_torch_thread):
    group = groups_from(TorchEngine(moe_dir, record_routing=True))[0]
    rollout = group.scored.rollout
    s = rollout.samples[0]
    r = s.routed_experts
    assert r is not None
    short = WireTensor(dtype="uint8", shape=(r.shape[0] - 1, *r.shape[1:]), data=r.data[: -r.shape[1] * r.shape[2]])
    with pytest.raises(ValidationError, match="routed_experts covers"):
        RolloutGroup(**{**dict(rollout), "samples": (s.model_copy(update={"routed_experts": short}),)})


def test_a_group_without_routing_cannot_train_under_r3(moe_dir, one_torch_thread):
    trainer = trainer_for(moe_dir, "r3")
    plain = groups_from(TorchEngine(moe_dir))[0]
    assert "carries no routed experts" in (trainer.untrainable(plain) or "")
    assert trainer.untrainable(groups_from(TorchEngine(moe_dir, record_routing=True))[0]) is None


def test_refusals(moe_dir, model_dir):
    with pytest.raises(ValueError, match=r"needs an MoE model|no \*TopKRouter"):
        TorchEngine(model_dir, record_routing=True)
    with pytest.raises(ValueError, match="sim engine cannot record routed experts"):
        make_engine("sim", moe_dir, record_routing=True)
    with pytest.raises(ValueError, match="vllm engine cannot record routed experts"):
        make_engine("vllm", moe_dir, record_routing=True)
    with pytest.raises(ConfigError, match="only the torch engine"):
        parse_config({"run": "t", "rollout": {"engine": "vllm"}, "trainer": {"moe": {"routing_replay": "r3"}}})
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        parse_config(
            {"run": "t", "trainer": {"moe": {"routing_replay": "r3"}, "compute": {"activation_checkpointing": True}}}
        )
    with pytest.raises(ConfigError, match="one trainer process"):
        parse_config({"run": "t", "trainer": {"moe": {"routing_replay": "r2"}, "distributed": {"nproc": 2}}})
    dense = parse_config({"run": "t", "trainer": {"moe": {"routing_replay": "r3"}}})
    with pytest.raises(ValueError, match="needs an MoE model"):
        PolicyTrainer(model_dir, dense)


def test_replay_refuses_a_plan_of_another_shape(moe_dir):
    model = copy.deepcopy(make_engine("torch", moe_dir).model)
    ids = torch.tensor([[257, 50, 51]])
    with pytest.raises(ValueError, match="forced routing"), replaying(model, [torch.zeros(2, 2, 2, dtype=torch.long)]):
        model(input_ids=ids)


@pytest.mark.bus
async def test_routing_travels_by_claim_check_on_the_train_stream(make_bus, moe_dir, one_torch_thread):
    bus = await make_bus(bus={"claim_check_bytes": 1024})
    group = groups_from(TorchEngine(moe_dir, record_routing=True), n=16)[0]
    assert len(encode(group)) > 1024  # the routing and the samples take it over the threshold
    await bus.publish("train", group)
    raw = await bus.js.get_msg(bus.topology.stream("train").name, 1)
    assert raw.headers[CLAIM].startswith("sha256:") and not raw.data
    back = await open_message(raw.data or b"", raw.headers, bus.media)
    assert back == group
    routes = [routed_experts(s.routed_experts) for s in back.scored.rollout.samples]
    assert all(r is not None and r.shape[1:] == (2, 2) for r in routes)


def test_a_zero_metrics_fraction_skips_the_free_forward(moe_dir, one_torch_thread):
    groups = groups_from(TorchEngine(moe_dir, record_routing=True))
    metrics = trainer_for(moe_dir, "r3", moe={"metrics_fraction": 0}).step(groups)
    assert metrics["routing_agreement"] == 1.0 and metrics["routing_mismatch_replay_max"] < 1e-5
    assert "routing_mismatch_free" not in metrics


def test_the_plans_place_each_rows_routing_where_the_forward_feeds_its_tokens():
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [3, 3, 5, 5, 2], [4, 1, 6, 2, 3]
    lengths = [p + n for p, n in zip(prompts, responses, strict=True)]
    routes = [torch.randint(0, 8, (n - 1, 2, 2), generator=gen, dtype=torch.uint8) for n in lengths]
    width = max(lengths)
    plain = plain_plan(routes, width, 2, 2).view(len(routes), width, 2, 2)
    for i, r in enumerate(routes):
        assert torch.equal(plain[i, : len(r)], r.long()) and bool((plain[i, len(r) :] == -1).all())
    first = [0, 2, 4]
    call_prompts, call_responses = grouped_plan(routes, prompts, responses, first)
    p_width, feed = max(prompts), max(responses) - 1
    call_prompts = call_prompts.view(len(first), p_width, 2, 2)
    for g, i in enumerate(first):
        p = prompts[i]
        assert torch.equal(call_prompts[g, p_width - p :], routes[i][:p].long())
        assert bool((call_prompts[g, : p_width - p] == -1).all())
    call_responses = call_responses.view(len(routes), feed, 2, 2)
    for i, (r, p, n) in enumerate(zip(routes, prompts, responses, strict=True)):
        assert torch.equal(call_responses[i, : n - 1], r[p : p + n - 1].long())
        assert bool((call_responses[i, n - 1 :] == -1).all())

"""LoRA (`trainer.lora`): adapter-only training, adapter versions fenced by the base's digest, the torch engine
applying them in place, adapter checkpoints, and the export as a peft adapter or a merged model."""

from __future__ import annotations

import pytest
import torch

from relax_bus.errors import BlobNotFound, ConfigError
from tests.workers.test_microbatch import PROMPTS, _varied
from tests.workers.test_trainer import engine_groups
from workers.config import parse_config
from workers.config.trainer_sections import LoraConfig
from workers.data.models import load_model, materialize
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.errors import CheckpointRefused, WeightsBaseMismatch
from workers.training.forward import SharedPromptForward
from workers.training.logprobs import token_logprobs
from workers.training.trainer import PolicyTrainer
from workers.weights.adapter import apply_adapter, inject, merged, published, save_adapter, split
from workers.weights.adapter_wire import RECORD, AdapterTransport
from workers.weights.files import FilesystemTransport

pytestmark = pytest.mark.workers
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize("tiny:64x2", tmp_path_factory.mktemp("m") / "m", seed=4)
    groups = [_varied(g, i) for i, g in enumerate(engine_groups(TorchEngine(model_dir), PROMPTS, n=4))]
    return model_dir, groups


def config(**trainer):
    options = {"optim": {"lr": 1e-2, "grad_clip": 1e9}, "lora": LORA, **trainer}
    return parse_config(
        {
            "run": "lora",
            "groups_per_step": len(PROMPTS),
            "samples_per_group": 4,
            "rollout": {"temperature": 0.8, "max_new_tokens": 5},
            "trainer": options,
        }
    )


def test_lora_is_off_by_default_and_refused_where_it_cannot_run():
    base = {"run": "x", "trainer": {"lora": LORA}}
    assert parse_config({"run": "x"}).trainer.lora is None
    assert parse_config(base).trainer.lora == LoraConfig(**LORA)
    refusals = {
        "rollout": ({"engine": "sim"}, "trainer.lora needs the torch or vllm rollout engine, not sim"),
        "weights": ({"type": "object_store", "delta": True}, "trainer.lora already publishes only the adapter"),
    }
    for key, (value, line) in refusals.items():
        with pytest.raises(ConfigError, match=line):
            parse_config({**base, key: value})
    with pytest.raises(ConfigError, match=r"trainer.lora with moe.routing_replay r2"):
        parse_config({"run": "x", "trainer": {"lora": LORA, "moe": {"routing_replay": "r2"}}})
    with pytest.raises(ConfigError, match=r"trainer.lora trains text policies only"):
        parse_config({**base, "model": {"source": "tiny-omni"}})


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(setup):
    model_dir, groups = setup
    # micro-batches of 24 padded tokens, two mini-batches, the shared-prompt forward (on by default)
    t = PolicyTrainer(model_dir, config(mini_batches=2, compute={"micro_batch_tokens": 24}))
    trained = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 3 * 2  # A and B, three target modules, two layers
    held = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in t.model.named_parameters() if n in trained}
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    metrics = t.step(groups)
    assert metrics["updates"] == 2 and isinstance(t.forward, SharedPromptForward)
    after = t.model.state_dict()
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and changed <= {k for k in after if ".lora_" in k}
    assert any(".lora_A." in k for k in changed), "the second update moves A too (B left zero after the first)"
    # published names: the base's own names and the adapter's peft-saved names; `adapter_state` is the adapter alone
    full = t.full_state()
    assert "model.layers.0.self_attn.q_proj.weight" in full and "model.layers.0.self_attn.q_proj.lora_A.weight" in full
    assert set(t.adapter_state()) == set(split(full)[1]) and not split(t.adapter_state())[0]


def test_the_shared_prompt_forward_gives_the_plain_gradient_of_the_adapter(setup):
    model_dir, groups = setup
    grads = []
    for shared in (True, False):
        t = PolicyTrainer(model_dir, config(compute={"shared_prompt": shared, "micro_batch_tokens": 24}))
        t.model.get_parameter("model.layers.0.self_attn.q_proj.lora_B.default.weight").data.normal_(0, 0.1)
        t.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
        t.step(groups)
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 12
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


class Versions:
    """The two sides of a LoRA run's transport over a real one (files on disk)."""

    def __init__(self, tmp_path, run="r"):
        self.inner = FilesystemTransport(run, keep=2, root=tmp_path)
        self.publisher = AdapterTransport(self.inner, LoraConfig(**LORA))


async def test_adapter_versions_carry_the_base_digest_and_a_reader_with_another_base_refetches(setup, tmp_path):
    model_dir, groups = setup
    t = PolicyTrainer(model_dir, config())
    side = Versions(tmp_path)
    v0 = t.full_state()
    await side.publisher.publish(0, v0, 0)
    t.step(groups)
    a1 = t.adapter_state()
    await side.publisher.publish(1, a1, 1)
    stored = await side.inner.read(1)
    assert set(stored) == {*a1, RECORD}, "v1 holds the adapter and its record only"
    assert sum(v.numel() for v in a1.values()) * 30 < sum(v.numel() for v in v0.values())  # rank 4 on hidden 64

    reader = AdapterTransport(side.inner, LoraConfig(**LORA))
    got = await reader.read(1)  # no base yet: v0's base comes along, once
    assert set(got) == set(split(v0)[0]) | set(a1) and (reader.base_reads, reader.adapter_reads) == (1, 0)
    await side.publisher.publish(2, t.adapter_state(), 2)
    assert set(await reader.read(2)) == set(a1) and (reader.base_reads, reader.adapter_reads) == (1, 1)

    # A reader whose base is another one (the digest differs) fetches v0; a v0 of yet another base is refused.
    reader.base = "another"
    assert set(await reader.read(2)) == set(got) and reader.base_reads == 2
    other = Versions(tmp_path / "other")
    other_base = {k: v + 1 if v.is_floating_point() else v for k, v in v0.items()}
    await other.publisher.publish(0, other_base, 0)
    await other.inner.publish(1, await side.inner.read(1), 1)  # v1 of the first run next to the other base
    with pytest.raises(WeightsBaseMismatch, match="this run's v0 is another base"):
        await AdapterTransport(other.inner, LoraConfig(**LORA)).read(1)
    with pytest.raises(ValueError, match="only the adapter is published after v0"):
        await side.publisher.publish(3, v0, 3)
    # weights.keep counts adapter versions: v0 and the newest 2 stay
    await side.publisher.publish(3, t.adapter_state(), 3)
    with pytest.raises(BlobNotFound):
        await side.inner.read(1)


def test_the_engine_applies_adapters_in_place_and_samples_base_plus_adapter_logprobs(setup):
    model_dir, groups = setup
    t = PolicyTrainer(model_dir, config())
    t.step(groups)
    t.step(groups)
    engine = TorchEngine(model_dir, lora=LoraConfig(**LORA))
    engine.load_state_dict(t.full_state(), 0)  # v0: base and adapter
    pointers = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    t.step(groups)
    adapter = t.adapter_state()
    engine.load_state_dict(adapter, 1)
    assert engine.version == 1
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == pointers, "nothing rebuilt"
    own = published(engine.model.state_dict())
    assert all(torch.equal(own[k], v) for k, v in adapter.items())
    with pytest.raises(ValueError, match="adapter does not fit the model"):
        apply_adapter(engine.model, {"nope.lora_A.weight": torch.zeros(1)})

    # The sampled log-probs are the teacher-forced ones of a plain model with base + (alpha / r) B A merged in.
    tok = engine.tokenizer
    prompt = [tok.bos_token_id, *tok.encode("3+4=", add_special_tokens=False)]
    out = engine.generate([prompt], 3, SamplingSettings(temperature=0.8, max_new_tokens=6, seed=1))[0]
    plain = load_model(model_dir)
    plain.load_state_dict(merged(t.full_state(), LoraConfig(**LORA)))
    plain.eval()
    for g in out:
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            want = token_logprobs(plain, ids, torch.ones_like(ids), temperature=0.8)[0, len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-4)


def test_checkpoints_hold_the_adapter_and_its_optimizer_state_and_refuse_another_base(setup, tmp_path):
    model_dir, groups = setup
    t = PolicyTrainer(model_dir, config())
    t.step(groups)
    data = t.checkpoints.to_bytes({"step": 1})
    state = torch.load(__import__("io").BytesIO(data), weights_only=True)
    assert state["base"] == t.base_digest and set(state["model"]) == {
        n for n, p in t.model.named_parameters() if p.requires_grad
    }
    t.step(groups)
    want = {k: v.clone() for k, v in t.model.state_dict().items()}
    resumed = PolicyTrainer(model_dir, config())
    assert resumed.checkpoints.restore(data) == {"step": 1}
    resumed.step(groups)
    got = resumed.model.state_dict()
    assert all(torch.allclose(got[k], v, atol=1e-6) for k, v in want.items()), "Adam's moments came back too"
    other = PolicyTrainer(materialize("tiny:64x2", tmp_path / "other", seed=9), config())
    with pytest.raises(CheckpointRefused, match="this trainer's base"):
        other.checkpoints.restore(data)


def test_the_adapter_exports_for_peft_and_merged_for_transformers(setup, tmp_path):
    from peft import PeftModel

    model_dir, groups = setup
    t = PolicyTrainer(model_dir, config())
    t.step(groups)
    t.step(groups)
    lora = LoraConfig(**LORA)
    save_adapter(t.full_state(), lora, model_dir, tmp_path / "adapter")
    peft = PeftModel.from_pretrained(load_model(model_dir), tmp_path / "adapter").eval()
    plain = load_model(model_dir)
    plain.load_state_dict(merged(t.full_state(), lora))
    ours = inject(load_model(model_dir), lora).eval()
    ours.load_state_dict(t.model.state_dict())
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        assert torch.allclose(peft(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(plain(input_ids=ids).logits, want, atol=1e-5)
        assert not torch.allclose(load_model(model_dir)(input_ids=ids).logits, want, atol=1e-5), "the adapter moved"

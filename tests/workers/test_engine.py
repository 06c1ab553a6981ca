"""The byte tokenizer, tiny model sources, teacher-forced log-probs and what is the torch engine's own.

What every engine keeps (samples, log-probs, stopping, weight loads, seeds) is tests/workers/test_engine_contract.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedModel

from tests.workers.test_engine_contract import prompts_of
from workers.config.hub import HubSettings
from workers.data.models import load_model, load_tokenizer, materialize
from workers.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_byte_tokenizer
from workers.engines.base import SamplingSettings, make_engine
from workers.engines.torch_engine import TorchEngine
from workers.training.logprobs import token_logprobs

pytestmark = pytest.mark.workers

ODD_TEXTS = ["", "héllo wörld", "🙂👍🏽 emoji", "日本語", "\x00\x01\x7f\x80\xff", "  tabs\t\nand\r\n", "a<eos>b<pad>"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of this module runs with one torch thread (fixture in conftest.py)."""


@pytest.fixture
def engine(model_dir: Path) -> TorchEngine:
    return TorchEngine(model_dir)


PROMPTS = prompts_of("1+2=", "7+8=", "a much longer prompt, to force left padding=", "é")


def test_tokenizer_round_trips_odd_text_and_bytes() -> None:
    tok = build_byte_tokenizer()
    assert (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (VOCAB_SIZE, PAD_ID, BOS_ID, EOS_ID)
    for text in ODD_TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")), text  # one token per byte, no bos/eos added
        assert tok.decode(ids) == text
        assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID], skip_special_tokens=True) == text
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # a cut-off emoji decodes without raising


def test_tokenizer_saves_and_loads_offline(tmp_path: Path) -> None:
    build_byte_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (len(loaded), loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (259, 256, 257, 258)
    for text in ODD_TEXTS:
        assert loaded.decode(loaded.encode(text)) == text
        assert loaded.encode(text) == list(text.encode("utf-8"))


def test_materialize_tiny_builds_a_loadable_model_dir(tmp_path: Path) -> None:
    path = materialize("tiny", tmp_path / "m", seed=3)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    model = load_model(path)
    assert isinstance(model, LlamaForCausalLM) and not model.training
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (128, 2, 4, 512)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (259, 256, True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(load_tokenizer(path)) == 259
    again = load_model(materialize("tiny", tmp_path / "again", seed=3))
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert materialize("tiny", tmp_path / "m", seed=3) == path  # reused, not rebuilt
    small = load_model(materialize("tiny:64x1", tmp_path / "small"))
    assert (small.config.hidden_size, small.config.num_hidden_layers) == (64, 1)
    assert materialize(str(path), tmp_path / "unused") == path


def test_materialize_never_installs_a_directory_without_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # What transformers decides on a torch.distributed rank other than 0: write no config and no weights.
    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: False)
    with pytest.raises(RuntimeError, match=r"saved no config\.json, model\.safetensors .*build it on rank 0"):
        materialize("tiny:64x1", tmp_path / "m", seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the target nor a staging dir is left
    monkeypatch.undo()
    assert (materialize("tiny:64x1", tmp_path / "m", seed=0) / "config.json").is_file()


def test_materialize_rejects_bad_sources_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown model source 'gpt9'.*'tiny'.*'hf:<repo id>'"):
        materialize("gpt9", tmp_path / "x")
    with pytest.raises(ValueError, match=r"no config\.json"):
        materialize(str(tmp_path), tmp_path / "x")
    with pytest.raises(ValueError, match="multiple of 8"):
        materialize("tiny:12x1", tmp_path / "x")
    materialize("tiny:64x1", tmp_path / "m", seed=0)
    with pytest.raises(ValueError, match="already holds another model"):
        materialize("tiny:64x1", tmp_path / "m", seed=1)
    offline = HubSettings(hf_hub_offline=True, hf_hub_cache=tmp_path / "hub")
    monkeypatch.setattr("workers.data.hub_snapshot.hub_settings", lambda: offline)
    with pytest.raises(ValueError, match=r"^hf:nobody/no-such-model@main is not in the Hugging Face cache .*OFFLINE"):
        materialize("hf:nobody/no-such-model", tmp_path / "hf")


def test_make_engine_knows_torch_and_names_engines_for_unknown(model_dir: Path) -> None:
    assert isinstance(make_engine("torch", model_dir), TorchEngine)
    with pytest.raises(ValueError, match="unknown engine 'vllm9'; known engines: sim, torch"):
        make_engine("vllm9", model_dir)


def test_sampling_settings_reject_impossible_values() -> None:
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingSettings(**bad)


def test_token_logprobs_ignore_padding_side(engine: TorchEngine) -> None:
    seq = torch.tensor([PROMPTS[2]])
    plain = token_logprobs(engine.model, seq, torch.ones_like(seq), 0.7)  # [1, T-1]
    pad = torch.full((1, 3), PAD_ID)
    left = token_logprobs(engine.model, torch.cat([pad, seq], 1), torch.cat([pad * 0, seq * 0 + 1], 1), 0.7)
    right = token_logprobs(engine.model, torch.cat([seq, pad], 1), torch.cat([seq * 0 + 1, pad * 0], 1), 0.7)
    assert plain.dtype == torch.float32 and plain.shape == (1, seq.shape[1] - 1)
    assert (left[:, 3:] - plain).abs().max() < 1e-5 and (left[:, :3] == 0).all()
    assert (right[:, : plain.shape[1]] - plain).abs().max() < 1e-5 and (right[:, plain.shape[1] :] == 0).all()


def test_tiny_top_p_samples_the_argmax(engine: TorchEngine) -> None:
    out = engine.generate(PROMPTS, 2, SamplingSettings(top_p=1e-6, max_new_tokens=6, seed=0))
    with torch.no_grad():
        for prompt, samples in zip(PROMPTS, out, strict=True):
            for g in samples:
                seq = torch.tensor([prompt + g.token_ids])
                greedy = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].argmax(-1)
                assert greedy.tolist() == g.token_ids

"""Checks shared by the torch and vLLM engine tests: prompts, crafted weights, sample invariants."""

from __future__ import annotations

import torch
from torch import nn

from workers.data.tokenizer import BOS_ID, EOS_ID
from workers.engines.base import Generated


def prompts_of(*texts: str) -> list[list[int]]:
    """Token-id prompts (bos + bytes) for the byte tokenizer."""
    return [[BOS_ID, *t.encode()] for t in texts]


def one_direction_state(model: nn.Module, eos_gap: float) -> dict[str, torch.Tensor]:
    """Weights whose logits are flat except eos, which sits `eos_gap * sqrt(hidden)` above the rest.

    All layers are zero (the residual stream carries the embedding through), every embedding is e_0,
    and eos's is (1 + eos_gap) e_0; the final RMSNorm turns either into sqrt(hidden) e_0.
    The tied lm_head is left out: it arrives through its alias, the embedding.
    """
    state = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    for key in state:
        if key.endswith("norm.weight"):
            state[key] = torch.ones_like(state[key])
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 1.0
    embed[EOS_ID, 0] = 1.0 + eos_gap
    return state


def check_aligned_samples(
    out: list[list[Generated]], tokenizer: object, prompts: int, n: int, max_new_tokens: int
) -> int:
    """Assert the invariants of an engine's output (n aligned samples per prompt); return the token count."""
    assert len(out) == prompts and all(len(samples) == n for samples in out)
    total = 0
    for g in (g for samples in out for g in samples):
        assert 1 <= len(g.token_ids) == len(g.logprobs) <= max_new_tokens
        assert all(lp <= 0 for lp in g.logprobs)
        assert g.text == tokenizer.decode(g.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        stopped = g.token_ids[-1] == EOS_ID
        assert g.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(g.token_ids) == max_new_tokens
        assert EOS_ID not in g.token_ids[:-1]
        total += len(g.token_ids)
    return total

"""Drawing one token per row from a tempered distribution, restricted to the nucleus `top_p`: the torch engine's
sampler, shared by one-turn generation and the turns of episodes on one cache."""

from __future__ import annotations

import torch


def draw(logp: torch.Tensor, top_p: float, generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """Sample one token per row from exp(logp) [B, V], restricted to the smallest nucleus of mass >= top_p.

    `generator` is one generator for the batch, one per row (each row's draw independent of the others), or None.
    """
    probs = logp.exp()  # [B, V]
    if top_p >= 1.0:
        return multinomial(probs, generator).squeeze(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, V]
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before a token already reaches top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    pick = multinomial(sorted_probs, generator)  # [B, 1]
    return order.gather(-1, pick).squeeze(-1)


def multinomial(weights: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """One draw per row of `weights` [B, V] -> [B, 1]."""
    if not isinstance(generator, list):
        return torch.multinomial(weights, 1, generator=generator)
    return torch.cat([torch.multinomial(weights[r : r + 1], 1, generator=g) for r, g in enumerate(generator)])

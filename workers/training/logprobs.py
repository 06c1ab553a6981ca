"""Teacher-forced token log-probabilities, the quantity the trainer, the reference role and the engines share.

For a sequence x and temperature tau, the log-prob of token x[t+1] is
`log_softmax(logits[t] / tau)[x[t+1]]`, over the full tempered distribution (no top-p renormalisation),
which is exactly what the generation engines report for the tokens they sample. Position ids follow
the attention mask, so left and right padding give the same values as an unpadded forward.
Gradients flow when the caller has them enabled (the trainer); wrap calls in `torch.no_grad()` otherwise.
"""

from __future__ import annotations

import torch
from torch import nn


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of each next token, `log_softmax(logits[:, t] / tau)[ids[:, t+1]]` -> [B, T-1] float32, 0 at pads."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mask = attention_mask.long()  # [B, T]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    logits: torch.Tensor = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False
    ).logits
    scaled = tempered(logits[:, :-1].float(), temperature)  # [B, T-1, V]
    targets = input_ids[:, 1:]  # [B, T-1]
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    out = picked - scaled.logsumexp(-1)  # [B, T-1]
    return out * (mask[:, :-1] * mask[:, 1:])  # only where both the context's last token and the target are real


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, without the [.., V]-sized copy (and its backward) when the temperature is 1."""
    return logits if temperature == 1.0 else logits / temperature


def response_logprobs(
    model: nn.Module, prompt_ids: list[int], responses: list[list[int]], temperature: float = 1.0
) -> list[torch.Tensor]:
    """Log-probs of each response's tokens after one shared prompt: one 1-D float32 tensor [len(response)] each."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token (the bos)")
    if not responses:
        return []
    device = next(model.parameters()).device
    if (rows := padded_rows(prompt_ids, responses, device)) is None:
        return [torch.zeros(0, dtype=torch.float32, device=device) for _ in responses]
    ids, mask = rows
    logps = token_logprobs(model, ids, mask, temperature)  # [n, T-1]
    return response_slices(logps, len(prompt_ids), responses)


def padded_rows(
    prompt_ids: list[int], responses: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, mask) [n, T] of prompt + response per row, right padded; None when every response is empty."""
    p = len(prompt_ids)
    width = p + max(len(r) for r in responses)
    if width == p:
        return None
    ids = torch.zeros(len(responses), width, dtype=torch.long, device=device)  # [n, T], right padded
    mask = torch.zeros_like(ids)
    for row, response in enumerate(responses):
        seq = torch.tensor(prompt_ids + response, dtype=torch.long, device=device)
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def response_slices(logps: torch.Tensor, prompt_len: int, responses: list[list[int]]) -> list[torch.Tensor]:
    """Each row's response part of token log-probs [n, T-1] (position t predicts token t+1)."""
    return [logps[row, prompt_len - 1 : prompt_len - 1 + len(r)] for row, r in enumerate(responses)]

"""The prompt-shared forward: each distinct prompt of a micro-batch is forwarded once and its key/value
cache reused for every response of its group, instead of forwarding the prompt once per sample.

    prompts   [G, P]   left padded; one forward with use_cache, logits kept for the last position only
    cache     [G, ...] -> [k, ...]  each response row takes its group's prompt keys/values (index_select)
    responses [k, R-1] right padded, all but the last token; positions continue after the prompt's
    logp[i, 0]  = log_softmax(prompt_logits[g(i), -1] / tau)[resp[i, 0]]
    logp[i, j]  = log_softmax(response_logits[i, j-1] / tau)[resp[i, j]]        j >= 1

The values and gradients are those of the plain pass over `prompt + response` rows (`token_logprobs`),
up to float rounding (the test checks 1e-5); the compute on prompt tokens drops by the group size n. Gradients
reach the prompt's activations through the cache, summed over the group's responses, as the plain pass sums
them over the prompt's copies. Not used under FSDP2 or with activation checkpointing (the trainer falls back
to the plain pass): both need one forward per backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workers.training.logprobs import tempered


def grouped_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    prompt_of: Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob of each response token after its prompt `prompts[prompt_of[i]]`: [k, R] float32, 0 past a row's end.

    `prompts` are the distinct prompts (at least one token each), `responses` the k rows, R the longest response.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(prompt_of) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(prompt_of)} prompt indices")
    if any(not p for p in prompts):
        raise ValueError("every prompt must hold at least one token (the bos)")
    device = next(model.parameters()).device
    k, width = len(responses), max((len(r) for r in responses), default=0)
    if k == 0 or width == 0:
        return torch.zeros(k, width, dtype=torch.float32, device=device)
    g_count, p_width = len(prompts), max(len(p) for p in prompts)
    prompt_ids = torch.zeros(g_count, p_width, dtype=torch.long)  # [G, P], left padded
    prompt_mask = torch.zeros_like(prompt_ids)
    for g, p in enumerate(prompts):
        prompt_ids[g, p_width - len(p) :] = torch.tensor(list(p))
        prompt_mask[g, p_width - len(p) :] = 1
    resp_ids = torch.zeros(k, width, dtype=torch.long)  # [k, R], right padded
    resp_mask = torch.zeros_like(resp_ids)
    for i, r in enumerate(responses):
        resp_ids[i, : len(r)] = torch.tensor(list(r))
        resp_mask[i, : len(r)] = 1
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    resp_ids, resp_mask = resp_ids.to(device), resp_mask.to(device)
    index = torch.tensor(list(prompt_of), dtype=torch.long, device=device)  # [k]

    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    first = tempered(out.logits[:, -1].float(), temperature)[index]  # [k, V]: each row's first response token
    logps = [_picked(first.unsqueeze(1), resp_ids[:, :1])]  # [k, 1]
    if width > 1:
        cache = out.past_key_values
        cache.reorder_cache(index)  # [G, ...] -> [k, ...]; index_select, so gradients flow back to the prompt
        lengths = prompt_mask.sum(-1)[index]  # [k]
        feed, feed_mask = resp_ids[:, :-1], resp_mask[:, :-1]  # the last token is only ever a target
        positions = lengths.unsqueeze(1) + torch.arange(width - 1, device=device).unsqueeze(0)  # [k, R-1]
        rest = model(
            input_ids=feed,
            attention_mask=torch.cat([prompt_mask[index], feed_mask], dim=1),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).logits.float()  # [k, R-1, V]
        logps.append(_picked(tempered(rest, temperature), resp_ids[:, 1:]))  # [k, R-1]
    # Joined as log-probs, not as logits: a [k, R, V] copy (and its gradient) would double the peak memory.
    return torch.cat(logps, dim=1) * resp_mask  # [k, R]


def _picked(scaled: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(scaled)[targets]: [k, r, V], [k, r] -> [k, r]."""
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)


def place(logps: torch.Tensor, prompt_lengths: Sequence[int], width: int) -> torch.Tensor:
    """Response log-probs [k, R] moved to the plain layout [k, width-1] (index p-1+j holds token j), 0 elsewhere."""
    k, r = logps.shape
    starts = torch.tensor([p - 1 for p in prompt_lengths], dtype=torch.long, device=logps.device)  # [k]
    cols = (starts.unsqueeze(1) + torch.arange(r, device=logps.device).unsqueeze(0)).clamp(max=width - 2)  # [k, R]
    # Columns past a row's end are clamped onto others of the same row: they add 0 there (scatter_add).
    return torch.zeros(k, width - 1, dtype=logps.dtype, device=logps.device).scatter_add(1, cols, logps)

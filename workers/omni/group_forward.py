"""Teacher-forced log-probs of a group's rows with the media towers run once per prompt, not once per row.

A GRPO group is n responses to one prompt. Passing the prompt's pixel patches and audio features with every
row would run the vision and audio towers n times on the same input. Here each distinct prompt of a batch is
embedded once, the Qwen2.5-Omni thinker's way (`get_input_embeddings`, then the audio, image and video features
scattered into their placeholder tokens), and its rows reuse that embedding (gradients from every row sum into
the one tower pass); the positions are the prompt's 3-D rotary positions followed by `last + 1, last + 2, ...` on
all three axes, what the engine feeds while decoding. The result equals `media_token_logprobs` on the same rows
with each row's own media (tested), at about 1/n of the towers' cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workers.omni.inputs import MediaInputs
from workers.omni.logprobs import mask_tokens, media_tensors, media_token_ids, rope_positions, scored_logprobs


def prompt_embeds(model: nn.Module, inputs: MediaInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's input embeddings with its media merged in [P, H], and its 3-D positions [3, P]."""
    ids = inputs["input_ids"]  # [1, P]
    media = media_tensors(inputs)
    embeds = model.get_input_embeddings()(ids)  # [1, P, H]
    if "input_features" in media:
        audio = model.get_audio_features(
            media["input_features"], media.get("feature_attention_mask"), return_dict=True
        ).last_hidden_state
        _, _, mask = model.get_placeholder_mask(ids, inputs_embeds=embeds)
        embeds = embeds.masked_scatter(mask, audio.to(embeds.dtype))
    for pixels, grid, which in (("pixel_values", "image_grid_thw", 0), ("pixel_values_videos", "video_grid_thw", 1)):
        if pixels not in media:
            continue
        get = model.get_image_features if which == 0 else model.get_video_features
        features = torch.cat(get(media[pixels], media[grid], return_dict=True).pooler_output, dim=0)
        features = features.to(embeds.dtype)
        kwargs = {"image_features": features} if which == 0 else {"video_features": features}
        mask = model.get_placeholder_mask(ids, inputs_embeds=embeds, **kwargs)[which]
        embeds = embeds.masked_scatter(mask, features)
    positions = rope_positions(model, ids, torch.ones_like(ids), media)  # [3, 1, P]
    return embeds[0], positions[:, 0]


def prompt_head(model: nn.Module, ids: torch.Tensor, inputs: MediaInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's embeddings [P, H] and 3-D positions [3, P]: `prompt_embeds` of its processor tensors, or for a
    text prompt (`inputs` None) the plain embeddings of `ids` [P] with one position per token on all three axes."""
    if inputs is not None:
        return prompt_embeds(model, {k: v.to(ids.device) for k, v in inputs.items()})
    return model.get_input_embeddings()(ids), torch.arange(len(ids), device=ids.device).expand(3, -1)


def grouped_media_logprobs(
    model: nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    media: Sequence[MediaInputs | None],
    group_of: Sequence[int],
    prompt_lengths: Sequence[int],
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, T-1] of right-padded rows `ids` [B, T] (row i answers group `group_of[i]`, whose prompt's
    tensors are `media[g]`, None for a text prompt), each prompt embedded once; 0 at pads and media targets."""
    device = ids.device
    lengths = attention.sum(-1).tolist()
    first = {g: r for r, g in reversed(list(enumerate(group_of)))}  # each group's first row
    prompts = {g: prompt_head(model, ids[r, : prompt_lengths[r]], media[g]) for g, r in first.items()}
    table = model.get_input_embeddings()
    rows, positions = [], []
    width = ids.shape[1]
    for r, (g, p, n) in enumerate(zip(group_of, prompt_lengths, lengths, strict=True)):
        head, head_pos = prompts[g]
        if head.shape[0] != p:
            raise ValueError(f"row {r}: prompt of {p} tokens, but its media prompt has {head.shape[0]}")
        tail = table(ids[r, p:])  # the response and the padding
        steps = torch.arange(1, width - p + 1, device=device)
        tail_pos = (head_pos[:, -1].max() + steps).expand(3, -1).clone()
        tail_pos[:, n - p :] = 1  # padding
        rows.append(torch.cat([head, tail]))
        positions.append(torch.cat([head_pos, tail_pos], dim=1))
    embeds = torch.stack(rows)  # [B, T, H]
    position_ids = torch.stack(positions, dim=1)  # [3, B, T]
    mask = attention.long()
    logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    suppressed = torch.tensor(media_token_ids(model.config), dtype=torch.long)
    return scored_logprobs(logits, ids, mask, temperature, suppressed)


@torch.no_grad()
def sample_after(
    model: nn.Module,
    prompts: Sequence[tuple[list[int], MediaInputs | None]],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
) -> list[tuple[list[int], bool]]:
    """One sampled completion per prompt (ids and media), all prompts in one left-padded batch: each prompt is
    embedded once, then each new token takes one forward of the whole batch (no KV cache; for short answers, such
    as the warm-up's accuracy check). Media special tokens are never sampled. Each completion comes with whether
    it ended at `eos_id` (not included) within `max_new_tokens`."""
    device = next(model.parameters()).device
    table = model.get_input_embeddings()
    heads = [prompt_head(model, torch.tensor(ids, device=device), inputs) for ids, inputs in prompts]
    width = max(h.shape[0] for h, _ in heads)
    rows, positions, masks = [], [], []
    for head, pos in heads:
        pad = width - head.shape[0]
        rows.append(torch.cat([head.new_zeros(pad, head.shape[1]), head]))
        positions.append(torch.cat([pos.new_ones(3, pad), pos], dim=1))
        masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(head.shape[0], dtype=torch.long)]))
    embeds, position_ids, mask = torch.stack(rows), torch.stack(positions, dim=1), torch.stack(masks).to(device)
    suppressed = torch.tensor(media_token_ids(model.config), dtype=torch.long)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        probs = (mask_tokens(logits[:, -1].float(), suppressed) / temperature).softmax(-1).cpu()
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                done[i] = token == eos_id
                if not done[i]:
                    out[i].append(token)
        if all(done):
            break
        step = tokens.to(device)
        embeds = torch.cat([embeds, table(step)[:, None]], dim=1)
        position_ids = torch.cat([position_ids, position_ids[:, :, -1:] + 1], dim=2)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return list(zip(out, done, strict=True))

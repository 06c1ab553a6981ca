"""Multi-turn generation on one KV cache: the torch engine's turns of a batch of episodes (`TorchEngine.open_turns`).

The episodes of one engine call keep one KV cache across their turns, so a turn never prefills the history again:
only what was appended since the last turn (the token that ended it, which was sampled but never fed, and the
observation ids) is fed, as one right-padded block. Finished episodes leave the batch (their rows are dropped from
the cache), so the rows still running fill the batch.

    mask [B, L]       1 on the cache positions that hold a real token of the row's episode; 0 on left padding, on
                      the padding of a fed block, and on what a row that already finished its turn was fed meanwhile
    positions         explicit: a row's next position is its count of real tokens, so gaps in the cache change
                      nothing a row attends to or how its tokens are rotated

Each sampled token's log-prob is under the full tempered distribution, as `TorchEngine.generate` reports it, and
equals the trainer's teacher-forced forward over the episode's contiguous ids (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.engines.base import Generated, SamplingSettings
from workers.engines.token_draw import draw


class TurnBatch:
    """The KV cache of a batch of episodes between their turns."""

    def __init__(self, engine: Any, contexts: Sequence[list[int]]) -> None:
        """`engine`: the `TorchEngine` whose model, tokenizer, sampling masks and token count the turns use."""
        if not contexts or any(not c for c in contexts):
            raise ValueError("every episode needs at least one token of context")
        self.engine = engine
        self.cache: Any = None
        self.mask = torch.zeros(len(contexts), 0, dtype=torch.long, device=engine.device)  # [B, L]
        self.lengths = [0] * len(contexts)
        """Real tokens of each row held in the cache."""
        self.pending: list[list[int]] = [list(c) for c in contexts]
        """Ids of each row not fed yet (the whole context, before the first turn)."""
        self.prefilled = 0
        """Tokens fed in blocks (prefill), for the re-prefill comparison."""

    @property
    def rows(self) -> int:
        return len(self.pending)

    def extend(self, row: int, ids: Sequence[int]) -> None:
        """Append ids (an observation) to `row`'s episode, fed before its next turn."""
        self.pending[row] += [int(i) for i in ids]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in this order): the others' episodes ended."""
        index = list(rows)
        if index == list(range(self.rows)):
            return
        self.pending = [self.pending[r] for r in index]
        self.lengths = [self.lengths[r] for r in index]
        picked = torch.tensor(index, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask[picked]
        if self.cache is not None:
            self.cache.batch_select_indices(picked)

    @torch.inference_mode()
    def turn(self, sampling: SamplingSettings, seeds: Sequence[int] | None = None) -> list[Generated]:
        """Feed what each row has pending, then sample one turn of every row (stop strings, eos or the token cap)."""
        engine = self.engine
        logits = self._feed()
        batch, steps, device = self.rows, sampling.max_new_tokens, engine.device
        generator: torch.Generator | list[torch.Generator] | None = None
        if seeds is not None:
            generator = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        elif sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        tokens = torch.full((batch, steps), engine.pad_id, dtype=torch.long, device=device)  # [B, S]
        logps = torch.zeros(batch, steps, dtype=torch.float32, device=device)  # [B, S]
        lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
        for step in range(steps):
            logp = torch.log_softmax(engine._masked(logits) / sampling.temperature, dim=-1)  # [B, V]
            tok = draw(logp, sampling.top_p, generator)  # [B]
            tokens[:, step] = tok
            logps[:, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            lengths += (~done).long()
            done |= torch.isin(tok, engine.eos_ids)
            if sampling.stop:
                done |= engine._at_stop(tokens, step, done, sampling.stop)
            if bool(done.all()) or step == steps - 1:
                break
            # Feed every row's token; a row that finished holds a masked slot (its last token waits in `pending`).
            live = (~done).long()
            positions = torch.tensor(self.lengths, dtype=torch.long, device=device)  # [B]
            self.mask = torch.cat([self.mask, live.unsqueeze(-1)], dim=-1)
            out = engine.model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=self.mask,
                position_ids=positions.unsqueeze(-1),
                past_key_values=self.cache,
                use_cache=True,
            )
            self.cache = out.past_key_values
            logits = out.logits[:, -1].float()
            self.lengths = [n + int(v) for n, v in zip(self.lengths, live.tolist(), strict=True)]
        out_rows = []
        eos = set(engine.eos_ids.tolist())
        for row, (toks, lps, length) in enumerate(zip(tokens.tolist(), logps.tolist(), lengths.tolist(), strict=True)):
            toks, lps = toks[:length], lps[:length]
            text = str(engine.tokenizer.decode(toks, skip_special_tokens=True))
            stopped = toks[-1] in eos or any(s in text for s in sampling.stop)
            self.pending[row] = [toks[-1]]  # sampled, never fed: it opens the next feed
            out_rows.append(Generated(toks, lps, text, "stop" if stopped else "length"))
        engine._tokens += int(lengths.sum())
        return out_rows

    def _feed(self) -> torch.Tensor:
        """Feed every row's pending ids as one right-padded block; the logits after each row's last one [B, V]."""
        engine, device = self.engine, self.engine.device
        width = max(len(p) for p in self.pending)
        ids = torch.full((self.rows, width), engine.pad_id, dtype=torch.long, device=device)  # [B, P]
        real = torch.zeros(self.rows, width, dtype=torch.long, device=device)  # [B, P]
        positions = torch.zeros(self.rows, width, dtype=torch.long, device=device)  # [B, P]
        for row, (pending, start) in enumerate(zip(self.pending, self.lengths, strict=True)):
            ids[row, : len(pending)] = torch.tensor(pending, dtype=torch.long, device=device)
            real[row, : len(pending)] = 1
            positions[row] = start + torch.arange(width, device=device).clamp(max=max(0, len(pending) - 1))
        self.mask = torch.cat([self.mask, real], dim=-1)
        out = engine.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, past_key_values=self.cache, use_cache=True
        )
        self.cache = out.past_key_values
        last = torch.tensor([len(p) - 1 for p in self.pending], dtype=torch.long, device=device)
        logits = out.logits[torch.arange(self.rows, device=device), last].float()  # [B, V]
        self.prefilled += sum(len(p) for p in self.pending)
        self.lengths = [n + len(p) for n, p in zip(self.lengths, self.pending, strict=True)]
        self.pending = [[] for _ in self.pending]
        return logits

"""A judge model's verdicts: its prompt from the run's template, and p(yes) from its logits or its generated text.

    logits   score = softmax([l_yes, l_no])[0]   l_*: the next-token logits of the first tokens of `yes` / `no`
    text     the first word of the greedy continuation: `yes` -> 1, `no` -> 0, anything else -> no score (an error)

A verdict that cannot be read is a typed outcome (`Judgement.error`), never a 0: the reward role turns it into an
excluded sample. The prompts of a group are forwarded in batches of `batch_size`, left-padded so every prompt's
last token sits at the last position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from schemas import Judgement
from workers.data.prompts import prompt_ids

if TYPE_CHECKING:
    from workers.config.judge import JudgeConfig


def judge_prompt(template: str, prompt: str, response: str, reference: str | None) -> str:
    """The template with the sample filled in (`reference` empty when the task has none)."""
    return template.format(prompt=prompt, response=response, reference=reference or "")


def first_token(tokenizer: Any, text: str) -> int:
    """The id of the first token of `text` (what a `logits` verdict reads); ValueError when it has none."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the verdict text {text!r} has no token")
    return int(ids[0])


def parse_verdict(text: str, yes: str, no: str) -> float | None:
    """1.0 when the text's first word is `yes`, 0.0 when it is `no` (case and surrounding punctuation ignored),
    None otherwise."""
    words = text.strip().split()
    if not words:
        return None
    first = words[0].strip(".,:;!\"'()[]").lower()
    if first == yes.strip().lower():
        return 1.0
    if first == no.strip().lower():
        return 0.0
    return None


@dataclass
class Judge:
    """A judge model loaded once, with the run's judge settings."""

    model: Any
    tokenizer: Any
    cfg: JudgeConfig

    def __post_init__(self) -> None:
        self.yes_id = first_token(self.tokenizer, self.cfg.yes_text)
        self.no_id = first_token(self.tokenizer, self.cfg.no_text)
        if self.yes_id == self.no_id:
            yes, no = self.cfg.yes_text, self.cfg.no_text
            raise ValueError(f"judge.yes_text {yes!r} and judge.no_text {no!r} start with one token")
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)

    def ids(self, text: str) -> list[int]:
        """The judge prompt's token ids, rendered as `judge.prompt_format` says."""
        return prompt_ids(self.tokenizer, text, self.cfg.prompt_format)

    @torch.no_grad()
    def judge(self, texts: Sequence[str]) -> list[Judgement]:
        """One judgement per judge prompt."""
        out: list[Judgement] = []
        size = self.cfg.batch_size
        for start in range(0, len(texts), size):
            rows = [self.ids(t) for t in texts[start : start + size]]
            if self.cfg.verdict == "logits":
                out.extend(self._by_logits(rows))
            else:
                out.extend(self._by_text(rows))
        return out

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            attention[i, width - len(r) :] = 1
        return ids, attention

    def _by_logits(self, rows: list[list[int]]) -> list[Judgement]:
        ids, attention = self._padded(rows)
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]  # [B, V]
        pair = logits[:, [self.yes_id, self.no_id]].float()  # [B, 2]
        p_yes = torch.softmax(pair, dim=-1)[:, 0]  # [B]
        threshold = self.cfg.threshold
        return [
            Judgement(score=float(p) if threshold is None else float(p >= threshold))
            if torch.isfinite(p)
            else Judgement(error="the judge's logits are not finite")
            for p in p_yes
        ]

    def _by_text(self, rows: list[list[int]]) -> list[Judgement]:
        ids, attention = self._padded(rows)
        generated = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            max_new_tokens=self.cfg.max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
        )[:, ids.shape[1] :]
        out = []
        for row in generated.tolist():
            text = str(self.tokenizer.decode(row, skip_special_tokens=True))
            score = parse_verdict(text, self.cfg.yes_text, self.cfg.no_text)
            if score is None:
                out.append(Judgement(error=f"unparsable verdict: {text[:80]!r}", verdict=text[:200]))
            else:
                out.append(Judgement(score=score, verdict=text[:200]))
        return out

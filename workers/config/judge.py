"""The judge section: a generative reward model (the `genrm` role; docs/judges.md)."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from workers.config.base import Section
from workers.config.model_source import ModelSource
from workers.config.rewards import RewardConfig

TEMPLATE_FIELDS = ("prompt", "response", "reference")
"""What a judge's template may name: the prompt's text, the sample's response and the task's reference answer."""


class JudgeConfig(Section):
    """A judge model that reads each sample and says whether it is right; its score joins the rule rewards."""

    source: ModelSource
    """The judge's weights, as `model.source` takes them: a model directory (`relax model judge-train` writes one)
    or `hf:<repo>`. Its tokenizer may differ from the policy's: the judge reads text."""
    seed: int = 0
    """Seed of the initial weights when the source is a model built in code."""
    template: str = "{prompt}{response}\nverdict:"
    """The judge's prompt, with `{prompt}`, `{response}` and `{reference}` (the task's answer) filled in."""
    prompt_format: Literal["auto", "chat", "raw"] = "raw"
    """How the filled template becomes token ids, as `model.prompt_format` (`chat`: a user turn of the judge's
    chat template)."""
    verdict: Literal["logits", "text"] = "logits"
    """`logits`: the score is p(yes) = softmax over the next-token logits of the first tokens of `yes_text` and
    `no_text`; `text`: the judge generates up to `max_new_tokens` greedily and its first word must be `yes_text` or
    `no_text` (1 or 0; anything else is an unparsable verdict: the sample is left out and counted)."""
    threshold: float | None = Field(default=None, gt=0, lt=1)
    """With `logits`: score 1 when p(yes) >= threshold, else 0 (None: the score is p(yes) itself). A hard verdict
    gives a group whose answers are all wrong no advantage, as a rule reward does; with p(yes), its answers are
    still ranked by how right the judge finds them, which pushes the policy towards the judge's mistakes."""
    yes_text: str = Field(default=" yes", min_length=1)
    """The text of a yes verdict (its first token is read in `logits` mode; the two must start with different
    tokens: with a byte tokenizer, `yes` and `no`)."""
    no_text: str = Field(default=" no", min_length=1)
    """The text of a no verdict."""
    max_new_tokens: int = Field(default=4, ge=1, le=256)
    """Tokens a `text` verdict may take."""
    weight: float = 1.0
    """Weight of the judge's score in the sample's reward (added to the weighted rule rewards of `rewards`)."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Longest a group's verdicts may take; past it every sample of the group is left out (a `judge timeout`)."""
    batch_size: int = Field(default=64, ge=1)
    """Judge prompts per forward pass."""
    check: RewardConfig | None = None
    """A rule reward logged beside the judge and never part of the reward (e.g. `exact`): per step, its mean
    (`judge_check_mean`: the true accuracy when the rule is exact), the judge's agreement with it and its
    false-positive rate (a yes where the check says wrong). Null: none."""

    @field_validator("template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            named = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as err:
            raise ValueError(f"the template does not parse: {err}") from None
        unknown = sorted(named - set(TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown template fields {unknown}: it may name {', '.join(TEMPLATE_FIELDS)}")
        if "response" not in named:
            raise ValueError("the template must contain {response}: the judge has to read the sample")
        return template

    @model_validator(mode="after")
    def _threshold_reads_logits(self) -> JudgeConfig:
        if self.threshold is not None and self.verdict != "logits":
            raise ValueError("threshold applies to verdict: logits (a text verdict already scores 1 or 0)")
        return self

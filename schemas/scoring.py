"""How a sample was scored: a judge model's verdict on it (`RolloutGroup.judgements`) and how its reward came about
(`ScoredGroup.details`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Judgement(BaseModel):
    """A judge model's verdict on one sample (the `genrm` role): a score, or why there is none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    score: float | None = Field(default=None, ge=0.0, le=1.0)
    """p(yes) read from the judge's next-token logits, or 1/0 parsed from its generated verdict; None on an error."""
    error: str | None = Field(default=None, max_length=500)
    """Why the judge gave no score (timeout, unparsable verdict, engine error): the sample is then left out of
    training and counted, never scored 0."""
    verdict: str = Field(default="", max_length=200)
    """The judge's generated text (text verdicts), cut to 200 characters."""

    @model_validator(mode="after")
    def _score_or_error(self) -> Judgement:
        if (self.score is None) == (self.error is None):
            raise ValueError("a judgement has a score or an error, not both and not neither")
        return self


class RewardDetail(BaseModel):
    """How one sample's reward came about."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    components: dict[str, float] = Field(default_factory=dict)
    """Named partial scores (e.g. correct, format)."""
    error: str | None = None
    """Set when the reward function failed, or the judge gave no verdict: the sample is left out of training."""
    checks: dict[str, float] = Field(default_factory=dict)
    """Values of the run's check rewards (`judge.check`), logged beside a judge's score, never part of the reward."""

"""A step's judge figures, from its groups' verdicts (`RolloutGroup.judgements`) and the rule logged beside the judge
(`RewardDetail.checks`, `judge.check`). A verdict is a yes when its score is at least 0.5; a check is right when its
value is.

    judge_error_rate           samples without a verdict (timeout, unparsable, engine error) / samples
    judge_score_mean           mean score over the samples with a verdict
    judge_check_mean           mean of the check over the samples that have one (the true accuracy, for `exact`)
    judge_agreement            samples where the judge's yes/no equals the check's / samples with both
    judge_false_positive_rate  samples the judge says yes and the check wrong / samples with both
    judge_yes_on_wrong         samples the judge says yes and the check wrong / samples with both, the check wrong
                               (the false-positive rate proper: it does not shrink as the policy stops being wrong)
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas import TrainGroup


def judge_metrics(groups: Sequence[TrainGroup], check: str | None) -> dict[str, float]:
    """The figures above for the step's groups; empty when none was judged. `check`: the check's label, or None."""
    pairs = []
    for g in groups:
        judgements = g.scored.rollout.judgements
        if judgements is None:
            continue
        details = g.scored.details or tuple(None for _ in judgements)
        pairs.extend(zip(judgements, details, strict=True))
    if not pairs:
        return {}
    scores = [j.score for j, _ in pairs if j.score is not None]
    out = {
        "judge_error_rate": (len(pairs) - len(scores)) / len(pairs),
        "judge_score_mean": sum(scores) / len(scores) if scores else float("nan"),
    }
    if check is None:
        return out
    with_check = [(j.score, d.checks[check]) for j, d in pairs if d is not None and check in d.checks]
    checked = [c for _, c in with_check]
    both = [(s >= 0.5, c >= 0.5) for s, c in with_check if s is not None]
    out["judge_check_mean"] = sum(checked) / len(checked) if checked else float("nan")
    out["judge_agreement"] = sum(y == c for y, c in both) / len(both) if both else float("nan")
    out["judge_false_positive_rate"] = sum(y and not c for y, c in both) / len(both) if both else float("nan")
    said_on_wrong = [y for y, c in both if not c]
    out["judge_yes_on_wrong"] = sum(said_on_wrong) / len(said_on_wrong) if said_on_wrong else float("nan")
    return out

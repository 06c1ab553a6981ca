"""Held-out evaluation as numbers: the `eval/*` values of one evaluation, from the rewards of its answers.

    greedy[i]       reward of item i's greedy answer                                   # [items]
    sampled[i][j]   reward of item i's j-th sampled answer                             # [items, k]
    correct         reward >= correct_at

    eval/greedy_accuracy   mean_i correct(greedy[i])
    eval/greedy_reward     mean_i greedy[i]
    eval/reward_mean       mean_ij sampled[i][j]
    eval/accuracy          mean_ij correct(sampled[i][j])      (pass@1 of the sampled answers)
    eval/pass_at_k         mean_i any_j correct(sampled[i][j])  (pass@k, k = the answers drawn per item: the
                                                               estimator of Chen et al. 2021 with n = k, exact)
    eval/k, eval/items, eval/version, eval/seconds

An evaluation travels as a `RunEvent` named `eval` whose fields are these values (`eval_event`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

EVAL_EVENT = "eval"
"""The name of the run event that carries one evaluation's values."""
VERSION = "eval/version"
"""The policy version evaluated: the key the sinks order and deduplicate evaluations by."""


def eval_values(greedy: Sequence[float], sampled: Sequence[Sequence[float]], correct_at: float) -> dict[str, float]:
    """The `eval/*` values (module docstring) of greedy rewards [items] and sampled rewards [items, k]."""
    if not greedy or len(greedy) != len(sampled) or any(not row for row in sampled):
        raise ValueError("an evaluation needs one greedy and at least one sampled reward per item, and an item")
    k = len(sampled[0])
    if any(len(row) != k for row in sampled):
        raise ValueError("every item needs the same number of sampled answers")
    items = len(greedy)
    flat = [r for row in sampled for r in row]
    return {
        "eval/greedy_accuracy": sum(r >= correct_at for r in greedy) / items,
        "eval/greedy_reward": sum(greedy) / items,
        "eval/reward_mean": sum(flat) / len(flat),
        "eval/accuracy": sum(r >= correct_at for r in flat) / len(flat),
        "eval/pass_at_k": sum(any(r >= correct_at for r in row) for row in sampled) / items,
        "eval/k": float(k),
        "eval/items": float(items),
    }


def eval_version(fields: Mapping[str, object]) -> int | None:
    """The policy version of an `eval` event's fields; None when they hold no whole number there."""
    value = fields.get(VERSION)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        return None
    return int(value)


def eval_numbers(fields: Mapping[str, object]) -> dict[str, float]:
    """The numeric `eval/*` fields of an `eval` event (anything else in it is passed over)."""
    return {
        k: float(v)
        for k, v in fields.items()
        if k.startswith("eval/") and isinstance(v, int | float) and not isinstance(v, bool)
    }


def eval_line(values: Mapping[str, float]) -> str:
    """One evaluation on the launcher's terminal: `eval v10: greedy 0.450  pass@4 0.800  reward 0.312 (20 items)`."""

    def shown(key: str) -> str:
        return f"{values[key]:.3f}" if key in values else "-"

    k = f"{values['eval/k']:.0f}" if "eval/k" in values else "k"
    version = int(values.get(VERSION, -1))
    items = int(values.get("eval/items", 0))
    return (
        f"eval v{version}: greedy {shown('eval/greedy_accuracy')}  pass@{k} {shown('eval/pass_at_k')}  "
        f"reward {shown('eval/reward_mean')} ({items} items)"
    )

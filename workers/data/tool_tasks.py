"""A task where a tool is necessary: two-digit `a+b` and `a*b`, worked with a calculator in agentic episodes.

`arithmetic(tool=True)` gives each item demonstrations of three kinds for the supervised warm-up, as segments of text
that are trained or not (the observation is the environment's, never the policy's):

    clean      <call>37*45</call> | <obs>1665</obs> | 1665        (the tool's observation not trained)
    direct     1665                                                (no call: right only when the model knows it)
    miscalled  <call>37*46</call> | <obs>1702</obs> | 1702        (a wrong digit in the call, copied faithfully)

The warm-up trains on the clean one, then (`trainer.warmup.label_noise`) on a mix of the other two (`miscalls` of it
miscalled), so RL starts from a policy that knows the format but calls the tool only sometimes, sometimes wrongly.
`tool=False` is the same problems as plain question and answer (the no-tool control).
"""

from __future__ import annotations

import random

from schemas.parts import TextPart
from workers.data.task_items import Demo, TaskItem, check_limit

OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


NOISY_DEMOS = 10
"""Noisy demonstrations per item: `round(miscalls * 10)` miscalled ones, the rest direct answers."""


def arithmetic(
    digits: int = 2,
    operations: str = "+*",
    tool: bool = True,
    seed: int | None = None,
    limit: int | None = None,
    template: str = "{a}{op}{b}=",
    miscalls: float = 0.2,
) -> list[TaskItem]:
    """Every `a op b` with a, b of exactly `digits` digits and op in `operations`; shuffled when `seed` is set.
    `miscalls`: the fraction of the noisy demonstrations that call the tool with a wrong digit (the others answer
    without it)."""
    if not 0 <= miscalls <= 1:
        raise ValueError(f"arithmetic: miscalls must be within 0..1, got {miscalls}")
    if not 1 <= digits <= 4:
        raise ValueError(f"arithmetic: digits must be 1 to 4, got {digits}")
    if not operations or any(op not in OPERATIONS for op in operations):
        raise ValueError(f"arithmetic: operations must be some of {''.join(OPERATIONS)!r}, got {operations!r}")
    try:
        template.format(a=0, b=0, op="+")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"arithmetic: template {template!r} may only name {{a}}, {{op}} and {{b}}: {err}") from None
    check_limit("arithmetic", limit)
    low, high = (10 ** (digits - 1) if digits > 1 else 0), 10**digits
    problems = [(a, op, b) for op in operations for a in range(low, high) for b in range(low, high)]
    rng = random.Random(seed)
    if seed is not None:
        rng.shuffle(problems)
    items = []
    for i, (a, op, b) in enumerate(problems[:limit]):
        answer = str(OPERATIONS[op](a, b))
        demos = _demos(a, op, b, answer, random.Random(f"{seed}/{i}"), miscalls) if tool else ()
        items.append(
            TaskItem(
                parts=(TextPart(text=template.format(a=a, b=b, op=op)),),
                answer=answer,
                task="arithmetic",
                index=i,
                demos=demos,
            )
        )
    return items


def _demos(a: int, op: str, b: int, answer: str, rng: random.Random, miscalls: float) -> tuple[Demo, ...]:
    """The clean demonstration of one problem, then its noisy ones: miscalled and direct, as `miscalls` says."""
    wrong_b = b + rng.choice([-1, 1]) if b % 10 not in (0, 9) else b + (1 if b % 10 == 0 else -1)
    wrong = str(OPERATIONS[op](a, wrong_b))
    clean: Demo = ((f"<call>{a}{op}{b}</call>", True), (f"<obs>{answer}</obs>", False), (answer, True))
    direct: Demo = ((answer, True),)
    miscalled: Demo = ((f"<call>{a}{op}{wrong_b}</call>", True), (f"<obs>{wrong}</obs>", False), (wrong, True))
    called = round(miscalls * NOISY_DEMOS)
    return (clean, *([miscalled] * called), *([direct] * (NOISY_DEMOS - called)))

"""Write word_problems.jsonl: GSM8K-style arithmetic word problems made here, with worked answers.

Each line is {"question": ..., "answer": "<worked solution> #### <number>"}, the GSM8K layout, so the
`hf` task reads it with `template: "{question}"` and `answer_regex: "####\\s*(.+)"`. Deterministic:
`python examples/data/make_word_problems.py` rewrites the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kai", "Lena"]
THINGS = ["apples", "stamps", "marbles", "books", "shells", "stickers", "pencils", "cookies"]


def buy_and_give(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(3, 30), rng.randint(2, 20)
    c = rng.randint(1, a + b - 1)
    n = a + b - c
    q = f"{name} has {a} {thing}. {name} gets {b} more and then gives {c} to a friend. How many {thing} are left?"
    return q, f"{name} has {a} + {b} = {a + b} {thing}, then {a + b} - {c} = {n}.", n


def boxes(rng: random.Random) -> tuple[str, str, int]:
    thing = rng.choice(THINGS)
    k, per, extra = rng.randint(2, 9), rng.randint(3, 12), rng.randint(0, 9)
    n = k * per + extra
    q = (
        f"A shop packs {thing} in boxes of {per}. It has {k} full boxes and {extra} loose {thing}. "
        f"How many {thing} does it have?"
    )
    return q, f"The boxes hold {k} x {per} = {k * per}; with the loose ones {k * per} + {extra} = {n}.", n


def share(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    friends, each = rng.randint(2, 8), rng.randint(2, 10)
    total = friends * each
    q = f"{name} shares {total} {thing} equally among {friends} friends. How many {thing} does each friend get?"
    return q, f"Each friend gets {total} / {friends} = {each}.", each


def money(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    price, count, paid = rng.randint(2, 15), rng.randint(2, 6), 0
    cost = price * count
    paid = cost + rng.randint(1, 20)
    n = paid - cost
    q = (
        f"{name} buys {count} tickets at ${price} each and pays with ${paid}. "
        f"How many dollars of change does {name} get?"
    )
    return q, f"The tickets cost {count} x {price} = {cost}; the change is {paid} - {cost} = {n}.", n


def main(count: int = 60, seed: int = 0) -> None:
    rng = random.Random(seed)
    makers = [buy_and_give, boxes, share, money]
    out = Path(__file__).with_name("word_problems.jsonl")
    lines = []
    for i in range(count):
        question, work, answer = makers[i % len(makers)](rng)
        lines.append(json.dumps({"question": question, "answer": f"{work} #### {answer}"}))
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {count} problems to {out}")


if __name__ == "__main__":
    main()

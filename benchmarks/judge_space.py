"""How a judge does on the answers RL will try: every task item against every answer of the task, and the empty one.

    python benchmarks/judge_space.py JUDGE_DIR [JUDGE_DIR ...] [--config examples/judge.yaml]
                                     [--out benchmarks/results/judge_space.json]

A judge's held-out agreement is measured on the samples it was trained from; under RL the policy tries, on an item,
the answers it gives to the others (and the empty answer, and whatever else the judge says yes to). This sets each of
CONFIG's task items against every distinct answer of the task and the empty response, labels each pair by CONFIG's
rule (`judge.check`, else the task's reward), and asks each judge directory as CONFIG's judge section reads samples
(its template and verdict texts; p(yes) >= 0.5 is a yes, whatever `judge.threshold` says). Per judge: the yes rate on
right pairs, on wrong ones, on the empty response, the items whose right answer has the highest p(yes) of all the
answers tried on them, and where the judge came from (its `relax_source.json`). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from workers.config import load_config, task_spec
from workers.data.models import load_model, load_tokenizer
from workers.data.tasks import load_task, prompt_text
from workers.launch.judge_data import rule_says_right, rule_scorer
from workers.rewards.judge import Judge, judge_prompt

ROOT = Path(__file__).resolve().parent.parent


def measure(judge_dir: Path, config_path: Path) -> dict[str, Any]:
    """One judge over CONFIG's answer space."""
    config = load_config(config_path, {"judge.source": str(judge_dir), "judge.threshold": None})
    assert config.judge is not None, f"{config_path} has no judge section"
    items = load_task(task_spec(config.task))
    answers = sorted({it.answer for it in items if it.answer is not None}, key=lambda a: (len(a), a))
    responses = ["", *answers]
    scorer = rule_scorer(config)
    judge = Judge(load_model(judge_dir).eval(), load_tokenizer(judge_dir), config.judge)
    yes_right, yes_wrong, yes_empty, top, right_n, wrong_n = 0, 0, 0, 0, 0, 0
    started = time.perf_counter()
    try:
        for item in items:
            question = prompt_text(item.parts)
            labels = [rule_says_right(scorer, r, item.answer) for r in responses]
            with torch.no_grad():
                scores = [
                    j.score or 0.0
                    for j in judge.judge(
                        [judge_prompt(config.judge.template, question, r, item.answer) for r in responses]
                    )
                ]
            for response, label, score in zip(responses, labels, scores, strict=True):
                said = score >= 0.5
                right_n += label
                wrong_n += not label
                yes_right += said and label
                yes_wrong += said and not label
                yes_empty += said and response == ""
            best = max(range(len(responses)), key=lambda i: scores[i])
            top += labels[best]
    finally:
        scorer.close()
    record_file = judge_dir / "relax_source.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    return {
        "judge": str(judge_dir),
        "items": len(items),
        "answers_tried": len(responses),
        "yes_on_right": yes_right / max(1, right_n),
        "yes_on_wrong": yes_wrong / max(1, wrong_n),
        "yes_on_empty": yes_empty / len(items),
        "right_answer_top_scored": top / len(items),
        "seconds": time.perf_counter() - started,
        "record": {
            k: record.get(k) for k in ("base", "data", "pairs", "steps", "best_step", "agreement", "balanced_agreement")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("judges", nargs="+", type=Path, help="judge model directories (relax model judge-train --out)")
    p.add_argument(
        "--config", type=Path, default=ROOT / "examples" / "judge.yaml", help="the run config (judge section)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "judge_space.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(d, args.config) for d in args.judges]
    print(
        "| judge | base | held-out agreement | yes on right | yes on wrong | yes on empty | right answer top-scored |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rec = r["record"]
        held = rec.get("agreement")
        print(
            f"| {Path(r['judge']).name} | {rec.get('base') or '?'} | {'-' if held is None else f'{held:.3f}'} | "
            f"{r['yes_on_right']:.3f} | {r['yes_on_wrong']:.3f} | {r['yes_on_empty']:.2f} | "
            f"{r['right_answer_top_scored']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "judge_space",
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"python": platform.python_version(), "platform": platform.platform()},
                "config": str(args.config),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

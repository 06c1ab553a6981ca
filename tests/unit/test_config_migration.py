"""The trainer's flat keys of earlier configs: each is refused with one line naming where it lives now."""

import pytest

from relax_bus.errors import ConfigError
from relax_bus.settings import flattened, incompatible_changes
from workers.config import PipelineConfig, parse_config
from workers.config.trainer import MOVED


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    return err.value.problems


def test_every_moved_key_is_one_line_naming_its_new_place_all_at_once():
    problems = problems_of({"run": "r", "trainer": {"lr": 1e-3, "tis_low": 0.1, "tis_high": 3.0, "nproc": 2}})
    assert problems == [
        "trainer.lr was removed: set trainer.optim.lr",
        "trainer.tis_low was removed: set trainer.correction: {type: tis, low: ...}",
        "trainer.tis_high was removed: set trainer.correction: {type: tis, high: ...}",
        "trainer.nproc was removed: set trainer.distributed.nproc",
    ]
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_moved_key_is_refused_with_its_migration(old):
    assert problems_of({"run": "r", "trainer": {old: 1}}) == [f"trainer.{old} was removed: set {MOVED[old]}"]


def test_the_new_key_of_every_moved_setting_exists():
    defaults = parse_config({"run": "r"}).trainer
    for new in MOVED.values():
        if ":" in new:  # a plug-in's own option: `trainer.loss: {type: ..., clip_low: ...}`
            section, option = new.removeprefix("trainer.").split(":")[0], new.split(", ")[-1].split(":")[0]
        else:
            section, option = new.removeprefix("trainer.").split(".")
        assert option in type(getattr(defaults, section)).model_fields, new


def test_moved_keys_are_listed_with_the_other_problems():
    problems = problems_of(
        {"run": "r", "groups_per_step": 0, "trainer": {"kl_coef": 0.1, "steps": 0, "optim": {"lr": -1}}}
    )
    assert "trainer.kl_coef was removed: set trainer.kl.coef" in problems
    assert any(p.startswith("trainer.steps: Input should be greater than or equal to 1") for p in problems)
    assert any(p.startswith("trainer.optim.lr: Input should be greater than 0") for p in problems)
    assert any(p.startswith("groups_per_step:") for p in problems)


def test_nested_sections_take_the_settings():
    t = parse_config(
        {
            "run": "r",
            "trainer": {
                "optim": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 0.5},
                "schedule": {"kind": "cosine", "warmup_updates": 2, "min_lr_ratio": 0.1},
                "checkpoint": {"every": 3, "keep": 2},
                "kl": {"coef": 0.05, "kind": "k3"},
                "loss": {"type": "ppo", "clip_low": 0.1, "clip_high": 0.2},
                "compute": {"micro_batch_tokens": None, "device": "cpu"},
            },
        }
    ).trainer
    assert (t.optim.lr, t.optim.weight_decay, t.optim.grad_clip) == (1e-3, 0.1, 0.5)
    assert (t.schedule.kind, t.schedule.warmup_updates, t.checkpoint.every, t.kl.kind) == ("cosine", 2, 3, "k3")
    assert (t.loss.clip_low, t.loss.clip_high, t.compute.micro_batch_tokens) == (0.1, 0.2, None)


def test_tunable_keys_name_existing_settings_and_checkpoint_cadence_may_change():
    flat = set(flattened(parse_config({"run": "r"}).model_dump()))
    for key in PipelineConfig.tunable - {"hops"}:
        assert key in flat, key
    old = parse_config({"run": "r"})
    new = parse_config({"run": "r", "trainer": {"checkpoint": {"every": 3, "keep": 9}}, "roles": {"rollout": 4}})
    assert incompatible_changes(old, new) == []
    lr = parse_config({"run": "r", "trainer": {"optim": {"lr": 1e-3}}})
    assert incompatible_changes(old, lr) == ["trainer.optim.lr: 0.0005 -> 0.001"]

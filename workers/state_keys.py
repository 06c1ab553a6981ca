"""Keys of a run's state KV bucket that the pipeline's roles read and write, in one place.

policy.version       updates published by the trainer (compare-and-set, only forward; the bus's own key:
                     `relax_bus.staleness`)
feeder.cursor        prompt groups released so far
groups.dropped       groups the trainer dropped as stale (returns credit to the feeder)
groups.filtered      release indices the reward role filtered as uniform (a bitmap; credit to the feeder)
trainer.step         optimizer steps done
trainer.checkpoint   JSON record of the latest checkpoint
trainer.done         set once the run's last step is trained
critic.checkpoint    JSON record of the critic's latest checkpoint (a run with a critic)
weights.broadcast    where the trainer's broadcast rendezvous listens (`weights: {type: broadcast}`)
eval.claimed         blocks of `eval.every` policy versions whose held-out evaluation a rollout worker has claimed
"""

from relax_bus.staleness import POLICY_VERSION

__all__ = [
    "CRITIC_CHECKPOINT",
    "EVAL_CLAIMED",
    "FEEDER_CURSOR",
    "GROUPS_DROPPED",
    "GROUPS_FILTERED",
    "POLICY_VERSION",
    "TRAINER_CHECKPOINT",
    "TRAINER_DONE",
    "TRAINER_STEP",
    "WEIGHTS_BROADCAST",
]

CRITIC_CHECKPOINT = "critic.checkpoint"
FEEDER_CURSOR = "feeder.cursor"
GROUPS_DROPPED = "groups.dropped"
GROUPS_FILTERED = "groups.filtered"
TRAINER_STEP = "trainer.step"
TRAINER_CHECKPOINT = "trainer.checkpoint"
TRAINER_DONE = "trainer.done"
WEIGHTS_BROADCAST = "weights.broadcast"
EVAL_CLAIMED = "eval.claimed"

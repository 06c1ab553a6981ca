"""Keys of a run's state KV bucket, in one place: every role reads some of them.

policy.version       updates published by the trainer (compare-and-set, only forward)
feeder.cursor        prompt groups released so far
groups.dropped       groups the trainer dropped as stale (returns credit to the feeder)
groups.filtered      release indices the reward role filtered as uniform (a bitmap; credit to the feeder)
trainer.step         optimizer steps done
trainer.checkpoint   JSON record of the latest checkpoint
trainer.done         set once the run's last step is trained
weights.broadcast    where the trainer's broadcast rendezvous listens (`weights: {type: broadcast}`)
"""

POLICY_VERSION = "policy.version"
FEEDER_CURSOR = "feeder.cursor"
GROUPS_DROPPED = "groups.dropped"
GROUPS_FILTERED = "groups.filtered"
TRAINER_STEP = "trainer.step"
TRAINER_CHECKPOINT = "trainer.checkpoint"
TRAINER_DONE = "trainer.done"
WEIGHTS_BROADCAST = "weights.broadcast"

"""Trainer checkpoints: whole (`whole`: one object of bytes gathered on rank 0), sharded (`sharded`: every rank's
shards in one directory), and the trainer's side of both (`trainer_state.TrainerCheckpoints`)."""

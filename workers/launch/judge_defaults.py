"""`relax model judge-train`'s defaults, apart so the command's help imports nothing heavy."""

JUDGE_TRAINING = {"steps": 2000, "lr": 1e-3}
"""A judge trained from a base model (a policy, or a model built in code)."""
JUDGE_RETRAINING = {"steps": 500, "lr": 3e-4}
"""With `--samples`: a trained judge retrained on the samples runs logged."""

"""Training: the policy trainer, its losses and advantages, log-probs, and the trainer across ranks."""

"""Omni-modal policies: a tiny Qwen2.5-Omni thinker built in code, media parts as processor tensors, log-probs."""

"""The RL roles (feeder, rollout, reward, reference, actor), their engines, rewards and the trainer.

Only this package may import torch, transformers or vllm.
"""

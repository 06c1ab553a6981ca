"""Relax-bus: the NATS JetStream data bus that couples the RL roles.

Kept free of imports so that `relax --help` answers at once; import submodules directly.
"""

"""The roles, one module each (`workers.role_registry` lists them), and how a role's process runs: `serve`
(`relax worker`) and `torchrun` (a role of several ranks re-executed under torchrun).
"""

"""SimEngine: a generation engine that runs no model; it sleeps for a drawn time and returns valid samples.

For measuring scheduling, staleness gating, the bus and the weight protocol without the cores being
the bottleneck (`benchmarks/cluster_sim.py`). The time model, set by `rollout.sim`:

    group time  g_i ~ LogNormal(ln median, sigma)          one draw per prompt group
    call time   max_i g_i                                  the groups of one call run side by side
                                                           (continuous batching): the longest decides
    load time   load_s                                     per weights version loaded

Samples are byte tokens of decimal digits, each with log-prob ln(1/10) and an eos at the end (or a
length stop), so the reward, reference and actor roles handle them like real ones.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from workers.data.tokenizer import EOS_ID
from workers.engines.base import Generated, SamplingSettings, check_call, refuse_routing

if TYPE_CHECKING:
    import torch

DIGITS = [ord(c) for c in "0123456789"]  # byte tokenizer: ids 0..255 are the bytes themselves
DIGIT_LOGPROB = -math.log(len(DIGITS))


def call_seconds(rng: random.Random, groups: int, median_s: float, sigma: float) -> float:
    """Time of one engine call on `groups` prompt groups: the longest of their log-normal draws."""
    if groups < 1 or median_s <= 0:
        return 0.0
    mu = math.log(median_s)
    return max(rng.lognormvariate(mu, sigma) for _ in range(groups))


class SimEngine:
    """The Engine interface over sleeps; weights are received and counted, never used."""

    name = "sim"
    max_context: int | None = None

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        group_median_s: float = 0.0,
        group_sigma: float = 0.0,
        load_s: float = 0.0,
        seed: int | None = None,
        record_routing: bool = False,
    ) -> None:
        refuse_routing("sim", record_routing, "it runs no model")
        self.model_dir = Path(model_dir)
        self.group_median_s = group_median_s
        self.group_sigma = group_sigma
        self.load_s = load_s
        self.rng = random.Random(seed)
        self.version = 0
        self.loads = 0
        self._tokens = 0

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, seeds: list[int] | None = None
    ) -> list[list[Generated]]:
        """Sleep for the call's drawn time; return n digit strings per prompt with uniform log-probs.

        With `seeds`, sample j of prompt i comes from `random.Random(seeds[i] + j)`; the timing never does.
        """
        check_call(prompts, n, seeds)
        time.sleep(call_seconds(self.rng, len(prompts), self.group_median_s, self.group_sigma))
        rngs = [random.Random(s + j) for s in seeds for j in range(n)] if seeds is not None else None
        flat = [self._sample(sampling.max_new_tokens, rngs[k] if rngs else self.rng) for k in range(len(prompts) * n)]
        out = [flat[i * n : (i + 1) * n] for i in range(len(prompts))]
        self._tokens += sum(len(g.token_ids) for samples in out for g in samples)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Take the weights (already fetched and decoded by the caller), sleep `load_s`, record the version."""
        if not state:
            raise ValueError("empty state dict")
        time.sleep(self.load_s)
        self.version = version
        self.loads += 1

    def tokens_generated(self) -> int:
        """Running count of tokens returned since the engine started (eos included)."""
        return self._tokens

    def _sample(self, max_new_tokens: int, rng: random.Random) -> Generated:
        digits = rng.randint(1, 2)
        if digits + 1 > max_new_tokens:  # no room for the eos: a length stop
            tokens = [rng.choice(DIGITS) for _ in range(max_new_tokens)]
            return Generated(tokens, [DIGIT_LOGPROB] * len(tokens), bytes(tokens).decode(), "length")
        tokens = [rng.choice(DIGITS) for _ in range(digits)]
        text = bytes(tokens).decode()
        return Generated([*tokens, EOS_ID], [DIGIT_LOGPROB] * (digits + 1), text, "stop")

"""The critic's value model and its update: a causal LM's body with a scalar head, trained on GAE returns.

    h        = body(ids, attention).last_hidden_state                     # [N, L, H]
    V[:, j]  = head(h[:, j])   the value of the state before token j + 1  # [N, L-1], laid out as `Batch.mask`

One group at a time (`CriticTrainer.train`): its values with the weights as they are (V_old, what the group carries
on to the actor), GAE returns from its rewards and V_old (`workers.training.gae`), then `critic.updates` AdamW
steps on PPO's clipped value loss, each clipping the gradient norm at `critic.grad_clip`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import Tensor, nn

from schemas import CriticValues, TrainGroup, WireTensor
from workers.config.critic import CriticConfig
from workers.errors import CheckpointRefused
from workers.training.batch import Batch, make_batch
from workers.training.gae import clipped_value_loss, explained_variance, gae
from workers.training.losses import masked_mean
from workers.training.optim import make_optimizer


class ValueModel(nn.Module):
    """A causal LM's decoder body (its LM head dropped) with a linear value head, initialised to 0."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.body: nn.Module = lm.get_decoder()  # type: ignore[operator]
        self.head = nn.Linear(int(lm.config.hidden_size), 1)  # type: ignore[union-attr]
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: Tensor, attention: Tensor) -> Tensor:
        """ids, attention [N, L] -> values [N, L-1] (position j: the state before token j + 1)."""
        hidden = self.body(input_ids=ids, attention_mask=attention).last_hidden_state  # [N, L, H]
        return self.head(hidden[:, :-1].float()).squeeze(-1)  # [N, L-1]


class CriticTrainer:
    """The value model, its optimizer and version (value updates made so far), and its update on one group."""

    def __init__(self, lm: nn.Module, config: CriticConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or torch.device("cpu")
        self.model = ValueModel(lm).to(self.device)
        self.optimizer = make_optimizer(self.model, config.lr, config.weight_decay)
        self.version = 0

    def values(self, batch: Batch) -> Tensor:
        """V [N, T-1] of a packed batch (with grad when enabled), on the CPU's layout of `batch.mask`."""
        return self.model(batch.ids.to(self.device), batch.attention.to(self.device))

    def train(self, group: TrainGroup) -> CriticValues:
        """V_old of the group's tokens, then `updates` clipped value-loss steps on its GAE returns; V_old and the
        figures of the first update, stamped with the version that computed V_old."""
        batch = make_batch([group])
        mask = batch.mask.to(self.device)  # [n, T-1]
        rewards = batch.rewards.reshape(-1).to(self.device)  # [n]
        self.model.eval()
        with torch.no_grad():
            old = self.values(batch)  # [n, T-1]
        _, returns = gae(rewards, old, mask, self.config.gamma, self.config.lam)
        version, first_loss = self.version, None
        self.model.train()
        for _ in range(self.config.updates):
            loss, _ = clipped_value_loss(self.values(batch), old, returns, mask, self.config.value_clip)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            first_loss = float(loss.detach()) if first_loss is None else first_loss
        self.version += 1
        valid = mask.bool()
        spans = zip(batch.prompt_lengths, batch.lengths, strict=True)  # response tokens at [p - 1, length - 1)
        per_sample = [old[i, p - 1 : n - 1].cpu().tolist() for i, (p, n) in enumerate(spans)]
        return CriticValues(
            version=version,
            values=tuple(WireTensor.from_values(v, "float32") for v in per_sample),
            value_loss=float(first_loss or 0.0),
            value_mean=masked_mean(old, valid),
            explained_variance=explained_variance(old, returns, mask),
        )

    def to_bytes(self, extra: dict[str, Any]) -> bytes:
        """Model, optimizer, version and `extra` as torch.save bytes (`restore` reads them without running code)."""
        buf = io.BytesIO()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extra": {**extra, "version": self.version},
        }
        torch.save(state, buf)
        return buf.getvalue()

    def restore(self, data: bytes) -> dict[str, Any]:
        """Load `to_bytes` output; its `extra`. CheckpointRefused when it is not a critic checkpoint."""
        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location=self.device)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointRefused(f"critic checkpoint refused, not loaded: {str(err).splitlines()[0]}") from None
        if not isinstance(state, dict) or not {"model", "optimizer", "extra"} <= state.keys():
            raise CheckpointRefused("critic checkpoint refused: not a critic checkpoint (model, optimizer, extra)")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        extra = dict(state["extra"])
        self.version = int(extra["version"])
        return extra

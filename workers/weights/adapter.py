"""LoRA adapters on a transformers model (peft), and the names their tensors travel and are stored under.

peft's `inject_adapter_in_model` wraps each target linear layer in place: its weight moves to
`<path>.base_layer.weight` and the adapter adds `<path>.lora_A.default.weight` [r, in] and
`<path>.lora_B.default.weight` [out, r], so the layer computes

    y = W x + (alpha / r) * B A dropout(x)                         # B starts at 0: the adapter starts as identity

On the wire and in exports the names are the model's own (`<path>.weight` for the base) and peft's saved
form for the adapter (`<path>.lora_A.weight`), so v0 loads into a plain model and an adapter state into any
model with the same adapter injected. The trainer, the torch engine, the reference role and `relax export`
all inject with the run's `trainer.lora` and so compute the same function of the same tensors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from workers.config.trainer_sections import LoraConfig
from workers.weights.transport import StateDict

ADAPTER = re.compile(r"(.*)\.lora_([AB])\.weight")
"""A published adapter tensor's name: `<module path>.lora_A.weight` or `.lora_B.weight`."""
PEFT_ADAPTER = re.compile(r"(.*)\.lora_([AB])\.default\.weight")
"""The same tensor's name inside a model peft injected (adapter name `default`)."""
BASE_LAYER = ".base_layer."


def is_adapter(name: str) -> bool:
    """Whether a published (or peft) tensor name is an adapter's A or B."""
    return ADAPTER.fullmatch(name) is not None or PEFT_ADAPTER.fullmatch(name) is not None


def inject(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Add the adapter to `model` in place (same module tree, target layers wrapped) and freeze everything but the
    adapter: afterwards exactly the `lora_A`/`lora_B` weights require gradients. Returns `model`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    inject_adapter_in_model(peft_cfg, model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"trainer.lora.target_modules {list(cfg.target_modules)} match no linear layer of the model")
    return model


def published_name(name: str) -> str:
    """A peft model's tensor name as it is published: `.base_layer.` and the adapter name `default` dropped."""
    if m := PEFT_ADAPTER.fullmatch(name):
        return f"{m[1]}.lora_{m[2]}.weight"
    return name.replace(BASE_LAYER, ".")


def published(state: StateDict) -> StateDict:
    """A peft model's state dict under the published names (`published_name`)."""
    return {published_name(k): v for k, v in state.items()}


def peft_names(model: nn.Module) -> dict[str, str]:
    """Published name -> the name inside `model` (a model peft injected), for every tensor of its state dict."""
    return {published_name(k): k for k in model.state_dict()}


def in_model(state: StateDict, model: nn.Module) -> StateDict:
    """A published state under `model`'s own names; names the model lacks are kept as they are (refused later)."""
    names = peft_names(model)
    return {names.get(k, k): v for k, v in state.items()}


def split(state: StateDict) -> tuple[StateDict, StateDict]:
    """(base tensors, adapter tensors) of a published state."""
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    return base, {k: v for k, v in state.items() if is_adapter(k)}


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's parameters of a model peft injected, by published name (what the optimizer holds)."""
    return {published_name(k): p for k, p in model.named_parameters() if is_adapter(k)}


@torch.no_grad()
def apply_adapter(model: nn.Module, adapter: StateDict) -> int:
    """Copy adapter tensors (published names) into a model peft injected, in place: no module is rebuilt, no
    other weight changes. ValueError unless the state names exactly the model's adapter tensors with their shapes.
    Returns the number of tensors copied."""
    own = adapter_params(model)
    missing, unexpected = sorted(own.keys() - adapter.keys()), sorted(adapter.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(f"adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in adapter.items():
        param = own[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"adapter tensor {name} has shape {tuple(tensor.shape)}, the model's {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))
    return len(adapter)


def merged(state: StateDict, lora: LoraConfig) -> StateDict:
    """A published base + adapter state merged into plain weights: for every adapted layer at path p,

        W_p = W_p + (alpha / r) * B_p @ A_p                       # [out, in] + [out, r] @ [r, in]

    and no adapter tensors left (what a model without peft loads)."""
    base, adapter = split(state)
    out = dict(base)
    scale = lora.alpha / lora.rank
    for name in adapter:
        m = ADAPTER.fullmatch(name)
        if m is None or m[2] != "A":
            continue
        weight = f"{m[1]}.weight"
        a, b = adapter[name].float(), adapter[f"{m[1]}.lora_B.weight"].float()
        out[weight] = (base[weight].float() + scale * (b @ a)).to(base[weight].dtype)
    return out


def save_adapter(state: StateDict, lora: LoraConfig, base_dir: object, out: object) -> None:
    """Write the adapter of a published state in peft's format into directory `out`: `adapter_config.json` and
    `adapter_model.safetensors` (tensors named `base_model.model.<path>.lora_A.weight`), which
    `PeftModel.from_pretrained(base, out)` loads."""
    from pathlib import Path

    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    folder = Path(str(out))
    folder.mkdir(parents=True, exist_ok=True)
    peft_cfg = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        base_model_name_or_path=str(base_dir),
        task_type="CAUSAL_LM",
    )
    peft_cfg.save_pretrained(str(folder))
    _, adapter = split(state)
    tensors = {f"base_model.model.{k}": v.detach().to("cpu").contiguous() for k, v in adapter.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})

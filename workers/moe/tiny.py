"""The `tiny-moe` model source: a Qwen3-MoE causal LM built in code over the byte tokenizer, offline.

Hidden 64, 2 decoder layers, each an MoE block of 8 experts (intermediate 64) routed top-2 with renormalised
scores; 4 attention heads / 2 KV heads, tied embeddings, fp32, 256 positions: about 0.24M parameters,
deterministic from the seed. Its routers are `Qwen3MoeTopKRouter` modules, which `workers.moe.routing` records
and replays.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from workers.data.model_build import TINY_POSITIONS, build_in_code
from workers.data.tokenizer import SPECIAL_IDS, build_byte_tokenizer

SOURCE = "tiny-moe"
EXPERTS = 8
TOP_K = 2


def tiny_moe_config() -> Qwen3MoeConfig:
    """The config of the `tiny-moe` source."""
    return Qwen3MoeConfig(
        vocab_size=len(build_byte_tokenizer()),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=TINY_POSITIONS,
        tie_word_embeddings=True,
        dtype="float32",
        **SPECIAL_IDS,
    )


def build_tiny_moe(target_dir: Path, seed: int = 0) -> Path:
    """Build (or reuse) the `tiny-moe` directory: model and byte tokenizer."""
    config = tiny_moe_config()
    return build_in_code({"source": SOURCE, "seed": seed}, lambda: Qwen3MoeForCausalLM(config), target_dir)

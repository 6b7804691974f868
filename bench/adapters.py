"""Benchmark adapters in PEFT's on-disk formats, written directly (an 8B/70B model need not be built
to make them): standard LoRA, or BD-LoRA with its block-diagonal factors stored without zeros.
Weights are random and non-zero. `tests/test_bench.py` checks that PEFT loads them as it loads its own.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from bench.shapes import LlamaShape
from vllm_bdlora.tiny import ALL_PROJECTIONS, BD_A, BD_B

# The BD-LoRA paper's rank pairs (standard r -> BD r'). Equal trainable parameters only where BD has about 4
# blocks (Llama-3.1-8B, r=64: 167.8M; BD r'=128 at nblocks 1/2/4/8: 335.5M, 226.5M, 172.0M, 144.7M); the
# sweep's tables list both counts, so a comparison says which it is.
PAPER_RANK_PAIRS = {16: 32, 64: 128, 256: 512}


def bd_rank_for(rank: int) -> int:
    """The BD rank compared with standard rank `rank` (twice it outside that table)."""
    return PAPER_RANK_PAIRS.get(rank, 2 * rank)


def factor_shapes(shape: LlamaShape, module: str, rank: int, nblocks: int | None) -> tuple[tuple, tuple]:
    d_in, d_out = shape.projections()[module]
    a, b = (rank, d_in), (d_out, rank)
    if nblocks and module in BD_A:
        a = (rank, d_in // nblocks)
    if nblocks and module in BD_B:
        b = (d_out, rank // nblocks)
    return a, b


def trainable_params(shape: LlamaShape, rank: int, nblocks: int | None = None) -> int:
    per_layer = 0
    for module in ALL_PROJECTIONS:
        a, b = factor_shapes(shape, module, rank, nblocks)
        per_layer += a[0] * a[1] + b[0] * b[1]
    return per_layer * shape.num_hidden_layers


def write_adapter(
    shape: LlamaShape,
    out_dir: str,
    rank: int,
    nblocks: int | None = None,
    seed: int = 0,
    std: float = 0.01,
    dora: bool = False,
) -> str:
    """Write adapter_config.json + adapter_model.safetensors (bf16) as PEFT saves them; with `dora`, also
    a lora_magnitude_vector per module (random, positive) and use_dora: true."""
    if os.path.exists(os.path.join(out_dir, "adapter_model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module in ALL_PROJECTIONS:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a, b = factor_shapes(shape, module, rank, nblocks)
            for name, dims in (("lora_A", a), ("lora_B", b)):
                tensors[f"{prefix}.{name}.weight"] = (torch.randn(dims, generator=generator) * std).to(torch.bfloat16)
            if dora:
                magnitude = 0.5 + torch.rand(b[0], generator=generator)
                tensors[f"{prefix}.lora_magnitude_vector"] = magnitude.to(torch.bfloat16)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(ALL_PROJECTIONS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": dora,
    }
    if nblocks:
        config["use_bdlora"] = {
            "target_modules_bd_a": list(BD_A),
            "target_modules_bd_b": list(BD_B),
            "nblocks": nblocks,
            "match_strict": True,
        }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir

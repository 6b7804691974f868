"""Plain-torch definitions of the kernels' contracts: the CPU serving path and the tests' reference.

Every path evaluates in float32 in the same order and rounds once, to the output dtype, at the end.
"""

from __future__ import annotations

import torch


def per_token_scale(scale_table: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """(tokens, cols) float32: row `slot` of `scale_table` for each token, 1 for slot -1 (no adapter)."""
    has_adapter = (token_slots >= 0)[:, None]
    rows = scale_table.float().index_select(0, token_slots.clamp(min=0).long())
    return torch.where(has_adapter, rows, torch.ones_like(rows))


def dora_compose_reference(
    base: torch.Tensor,
    lora: torch.Tensor,
    scale_table: torch.Tensor,
    token_slots: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """DoRA output per token, with g = `scale_table[slot]` (the magnitude scale m/||W + s·B·A||):

        y = base + ((g - 1)·(base - bias) + g·lora)

    `base` is the base layer's output including `bias` (bias is excluded from the scaling, as in PEFT);
    `lora` already carries the LoRA scaling s (vLLM folds it into B). (g - 1) is formed first so a g close
    to 1 does not cancel against base. Tokens with slot -1, and slots whose g row is all ones (plain LoRA
    adapters), get base + lora.
    """
    g = per_token_scale(scale_table, token_slots)
    base32 = base.float()
    unbiased = base32 - bias.float() if bias is not None else base32
    return (base32 + ((g - 1.0) * unbiased + g * lora.float())).to(base.dtype)

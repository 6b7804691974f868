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
    return _compose(base.float(), lora.float(), scale_table, token_slots, bias, base.dtype)


def _compose(base32, delta, scale_table, token_slots, bias, dtype) -> torch.Tensor:
    """The output formula every path shares, in float32 and rounded once: base + delta, or with a
    `scale_table` the DoRA compose base + ((g - 1)·(base - bias) + g·delta)."""
    if scale_table is None:
        return (base32 + delta).to(dtype)
    g = per_token_scale(scale_table, token_slots)
    unbiased = base32 - bias.float() if bias is not None else base32
    return (base32 + ((g - 1.0) * unbiased + g * delta)).to(dtype)


def lora_delta_reference(
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
) -> torch.Tensor:
    """(tokens, out) float32: scale[slot]·S[t, :rank]·B[slot, :, :rank]ᵀ per token, 0 for slot -1.
    `shrunk` (tokens, max_rank) = X·Aᵀ of each token's adapter; `lora_b` (slots, out, max_rank); columns
    beyond a slot's rank are ignored (heterogeneous ranks in one batch)."""
    delta = torch.zeros(shrunk.shape[0], lora_b.shape[1], dtype=torch.float32, device=shrunk.device)
    for slot in range(lora_b.shape[0]):
        rows = token_slots == slot
        rank = int(slot_ranks[slot])
        if rows.any() and rank:
            delta[rows] = float(slot_scales[slot]) * (shrunk[rows, :rank].float() @ lora_b[slot, :, :rank].float().T)
    return delta


def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, token_slots, slot_ranks) -> torch.Tensor:
    """(tokens, max_rank) float32: X·A[slot, :rank]ᵀ per token, zeros beyond the rank and for slot -1."""
    shrunk = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = token_slots == slot
        rank = int(slot_ranks[slot])
        if rows.any() and rank:
            shrunk[rows, :rank] = x[rows].float() @ lora_a[slot, :rank].float().T
    return shrunk


def fused_expand_reference(y, shrunk, lora_b, token_slots, slot_ranks, slot_scales, scale_table=None, bias=None):
    """The fused expand: y + LoRA delta (or, with `scale_table`, the DoRA compose of y and the delta)."""
    delta = lora_delta_reference(shrunk, lora_b, token_slots, slot_ranks, slot_scales)
    return _compose(y.float(), delta, scale_table, token_slots, bias, y.dtype)


def slice_views(lora_a, lora_b, slot_widths, slice_bounds):
    """Per slice j of a packed layer's combined buffers: (A_j (slots, width, in), B_j (slots, height_j,
    width)), views of lora_a (slots, slices·width, in) and lora_b (slots, total height, width)."""
    width = lora_b.shape[2]
    bounds = slice_bounds.tolist()
    return [
        (lora_a[:, j * width : (j + 1) * width], lora_b[:, bounds[j] : bounds[j + 1]])
        for j in range(slot_widths.shape[0])
    ]


def fused_lora_slices_reference(
    y, x, lora_a, lora_b, slot_widths, slice_bounds, token_slots, slot_scales=None, scale_table=None, bias=None
):
    """The fused shrink + expand of a whole packed layer (what `fused_lora_slices_` computes), slice by
    slice: y with each slice's columns passed through `fused_expand_reference`. slot_scales None: 1."""
    if slot_scales is None:
        slot_scales = torch.ones(lora_a.shape[0], dtype=torch.float32, device=x.device)
    out = y.clone()
    bounds = slice_bounds.tolist()
    for j, (a, b) in enumerate(slice_views(lora_a, lora_b, slot_widths, slice_bounds)):
        columns = slice(bounds[j], bounds[j + 1])
        table = scale_table[:, columns] if scale_table is not None else None
        bias_j = bias[columns] if bias is not None else None
        shrunk = lora_shrink_reference(x, a, token_slots, slot_widths[j])
        out[:, columns] = fused_expand_reference(
            y[:, columns], shrunk, b, token_slots, slot_widths[j], slot_scales, table, bias_j
        )
    return out


def lora_linear_slices_reference(x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots, bias=None):
    """A whole packed layer in one float32 accumulation, rounded once (the decode kernel's contract):
    X·Wᵀ (+ bias) + each token's delta over every slice; vLLM has folded the scaling into B."""
    base32 = x.float() @ weight.float().T
    if bias is not None:
        base32 = base32 + bias.float()
    ones = torch.ones(lora_a.shape[0], dtype=torch.float32, device=x.device)
    bounds = slice_bounds.tolist()
    for j, (a, b) in enumerate(slice_views(lora_a, lora_b, slot_widths, slice_bounds)):
        shrunk = lora_shrink_reference(x, a, token_slots, slot_widths[j])
        base32[:, bounds[j] : bounds[j + 1]] += lora_delta_reference(shrunk, b, token_slots, slot_widths[j], ones)
    return base32.to(x.dtype)

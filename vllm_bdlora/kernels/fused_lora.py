"""Fused multi-LoRA kernels (LoRAFusion-style split graph) with tile-level adapter routing.

Three kernels share one routing (`route_tokens`): tokens are sorted by LoRA slot and cut into tiles of
BLOCK_M rows that each belong to one slot (base-model tokens, slot -1, form their own tiles), so every tile
reads one adapter's weights. A small per-slot table gives the adapter's rank (heterogeneous ranks in one
batch: the rank loop stops at the tile's own rank instead of the buffer width), its scale, and (DoRA) its
magnitude-scale row.

* `lora_shrink`        S = X·A[slot, :rank]ᵀ per token (stored: tokens × max_rank, float32, tiny).
* `fused_expand`       y = y + s·S·B[slot]ᵀ in place, or the DoRA compose of y and that delta, one pass over y;
                       tiles of base-model tokens are skipped, so their rows are never touched.
* `fused_lora_linear`  out = X·Wᵀ (+ bias) + s·S·B[slot]ᵀ in one GEMM whose accumulator also takes the LoRA
                       term: the output is written once (no expand pass re-reading and re-writing it).

`reference.py` holds the contract of each (`lora_shrink_reference`, `fused_expand_reference`,
`fused_lora_linear_reference`). Routing and launches never sync with the host (CUDA-graph safe): tile
counts are bounded statically by cdiv(tokens, BLOCK_M) + slots + 1 and unused tiles exit at once.
`fused_lora_slices_` (custom op `torch.ops.vllm_bdlora.fused_lora_slices_`) is what BD layers call with
`additional_config {"bdlora": {"lora_kernels": "fused"}}`: the LoRA (and DoRA) part of a packed layer,
slice by slice, in place on the base output; CPU tensors take the torch references. Experimental: the
routing is recomputed per layer call, and the GPU path has not been benchmarked end to end yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

UNUSED_TILE = -2


@dataclass(frozen=True)
class TokenRouting:
    sorted_ids: torch.Tensor  # (tokens,) int32: token indices grouped by slot, base-model tokens last
    tile_slot: torch.Tensor  # (max_tiles,) int32: slot of each tile, -1 base-model tokens, -2 unused
    tile_start: torch.Tensor  # (max_tiles,) int32: first position in sorted_ids
    tile_end: torch.Tensor  # (max_tiles,) int32: end of the tile's slot group in sorted_ids
    block_m: int


def route_tokens(token_slots: torch.Tensor, num_slots: int, block_m: int) -> TokenRouting:
    """Group tokens by slot into single-slot tiles, with torch ops only (no host sync, static shapes)."""
    n = token_slots.shape[0]
    device = token_slots.device
    group = torch.where(token_slots < 0, num_slots, token_slots).long()
    sorted_ids = torch.argsort(group, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device).scatter_add_(0, group, torch.ones_like(group))
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(max(n, 1), block_m) + num_slots + 1
    tile = torch.arange(max_tiles, device=device)
    owner = torch.searchsorted(tiles_end, tile, right=True)
    used = owner <= num_slots
    owner = owner.clamp(max=num_slots)
    first = tiles_end[owner] - tiles[owner]
    tile_start = starts[owner] + (tile - first) * block_m
    tile_end = starts[owner] + counts[owner]
    slot = torch.where(owner == num_slots, -1, owner)
    tile_slot = torch.where(used, slot, UNUSED_TILE)
    return TokenRouting(sorted_ids, tile_slot.int(), tile_start.int(), tile_end.int(), block_m)


@triton.jit
def _tile_rows(sorted_ids_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M: tl.constexpr):
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs = start + tl.arange(0, BLOCK_M)
    row_ok = offs < end
    rows = tl.load(sorted_ids_ptr + offs, mask=row_ok, other=0).to(tl.int64)
    return rows, row_ok


@triton.jit
def _rows_dot(acc, x_ptr, m_ptr, rows, row_ok, cols, col_ok, hidden, stride_x, stride_m, BLOCK_K: tl.constexpr):
    """acc += X[rows, :]·M[cols, :]ᵀ over the hidden dimension (X·Aᵀ in the shrink, X·Wᵀ in the GEMM)."""
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        m = tl.load(m_ptr + cols[None, :] * stride_m + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, m)
    return acc


@triton.jit
def _lora_delta(
    acc, s_ptr, b_ptr, rows, row_ok, cols, col_ok, slot, rank, stride_s, stride_bl, stride_bn,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += S[rows, :rank]·B[slot, cols, :rank]ᵀ, stepping over the tile's own rank only."""
    for k0 in range(0, rank, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < rank
        s = tl.load(s_ptr + rows[:, None] * stride_s + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(s.to(tl.float32), b.to(tl.float32))
    return acc


@triton.jit
def _compose_and_store(
    out_ptr, base, delta, rows, row_ok, cols, col_ok, slot, stride_out, g_ptr, stride_g, bias_ptr,
    HAS_DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_DORA:
        adapted = col_ok & ((cols * 0 + slot) >= 0)  # slot -1 (base-model tile): g = 1
        g = tl.load(g_ptr + tl.maximum(slot, 0) * stride_g + cols, mask=adapted, other=1.0)[None, :]
        unbiased = base
        if HAS_BIAS:
            unbiased = base - tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = base + ((g - 1.0) * unbiased + g * delta)
    else:
        y = base + delta
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, s_ptr, sorted_ids_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, rank_ptr,
    hidden, stride_x, stride_al, stride_ar, stride_s,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(rank_ptr + slot)
    r0 = tl.program_id(1) * BLOCK_R
    if r0 >= rank:
        return
    rows, row_ok = _tile_rows(sorted_ids_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    rs = r0 + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc = _rows_dot(acc, x_ptr, a_ptr + slot * stride_al, rows, row_ok, rs, r_ok, hidden, stride_x, stride_ar, BLOCK_K)
    tl.store(s_ptr + rows[:, None] * stride_s + rs[None, :], acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _fused_expand_kernel(
    y_ptr, s_ptr, b_ptr, sorted_ids_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, rank_ptr, scale_ptr,
    g_ptr, bias_ptr, n_cols, stride_y, stride_s, stride_bl, stride_bn, stride_g,
    HAS_DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    rows, row_ok = _tile_rows(sorted_ids_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _lora_delta(acc, s_ptr, b_ptr, rows, row_ok, cols, col_ok, slot, tl.load(rank_ptr + slot),
                      stride_s, stride_bl, stride_bn, BLOCK_K)  # fmt: skip
    delta = acc * tl.load(scale_ptr + slot)
    mask = row_ok[:, None] & col_ok[None, :]
    base = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _compose_and_store(y_ptr, base, delta, rows, row_ok, cols, col_ok, slot, stride_y, g_ptr, stride_g, bias_ptr,
                       HAS_DORA, HAS_BIAS)  # fmt: skip


@triton.jit
def _fused_lora_linear_kernel(
    x_ptr, w_ptr, out_ptr, s_ptr, b_ptr, sorted_ids_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    rank_ptr, scale_ptr, g_ptr, bias_ptr, hidden, n_cols,
    stride_x, stride_w, stride_out, stride_s, stride_bl, stride_bn, stride_g,
    HAS_DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot == -2:
        return
    rows, row_ok = _tile_rows(sorted_ids_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    base = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    base = _rows_dot(base, x_ptr, w_ptr, rows, row_ok, cols, col_ok, hidden, stride_x, stride_w, BLOCK_K)
    if HAS_BIAS:
        base += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if slot >= 0:
        delta = _lora_delta(delta, s_ptr, b_ptr, rows, row_ok, cols, col_ok, slot, tl.load(rank_ptr + slot),
                            stride_s, stride_bl, stride_bn, BLOCK_R)  # fmt: skip
        delta = delta * tl.load(scale_ptr + slot)
    _compose_and_store(out_ptr, base, delta, rows, row_ok, cols, col_ok, slot, stride_out, g_ptr, stride_g, bias_ptr,
                       HAS_DORA, HAS_BIAS)  # fmt: skip


def _rows_major(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"fused LoRA kernels need unit stride in the last dimension, got shape {tuple(t.shape)}")


def lora_shrink(x, lora_a, routing: TokenRouting, slot_ranks, out=None, block_r: int = 16, block_k: int = 64):
    """S (tokens, max_rank) float32 = X·A[slot, :rank]ᵀ; lora_a (slots, max_rank, hidden)."""
    _rows_major(x, lora_a)
    if out is None:
        out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    grid = (routing.tile_slot.shape[0], triton.cdiv(lora_a.shape[1], block_r))
    _lora_shrink_kernel[grid](
        x, lora_a, out, routing.sorted_ids, routing.tile_slot, routing.tile_start, routing.tile_end, slot_ranks,
        x.shape[1], x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        BLOCK_M=routing.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def fused_expand(y, shrunk, lora_b, routing, slot_ranks, slot_scales, scale_table=None, bias=None, block_n=64):
    """In place on y (tokens, out): y += s·S·Bᵀ per token's slot, or the DoRA compose with `scale_table`."""
    _rows_major(y, shrunk, lora_b)
    grid = (routing.tile_slot.shape[0], triton.cdiv(y.shape[1], block_n))
    _fused_expand_kernel[grid](
        y, shrunk, lora_b, routing.sorted_ids, routing.tile_slot, routing.tile_start, routing.tile_end,
        slot_ranks, slot_scales, scale_table if scale_table is not None else slot_scales,
        bias if bias is not None else slot_scales, y.shape[1], y.stride(0), shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1), scale_table.stride(0) if scale_table is not None else 0,
        HAS_DORA=scale_table is not None, HAS_BIAS=bias is not None,
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=16,
    )  # fmt: skip
    return y


def fused_lora_linear(
    x, weight, shrunk, lora_b, routing, slot_ranks, slot_scales, bias=None, scale_table=None,
    out=None, block_n: int = 64, block_k: int = 64,
):  # fmt: skip
    """out (tokens, out_features) = X·Wᵀ (+ bias) + s·S·Bᵀ per token's slot (DoRA compose with
    `scale_table`), in one kernel; weight (out_features, hidden)."""
    _rows_major(x, weight, shrunk, lora_b)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    grid = (routing.tile_slot.shape[0], triton.cdiv(weight.shape[0], block_n))
    _fused_lora_linear_kernel[grid](
        x, weight, out, shrunk, lora_b, routing.sorted_ids, routing.tile_slot, routing.tile_start,
        routing.tile_end, slot_ranks, slot_scales, scale_table if scale_table is not None else slot_scales,
        bias if bias is not None else slot_scales, x.shape[1], weight.shape[0],
        x.stride(0), weight.stride(0), out.stride(0), shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        scale_table.stride(0) if scale_table is not None else 0,
        HAS_DORA=scale_table is not None, HAS_BIAS=bias is not None,
        BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=16,
    )  # fmt: skip
    return out


@torch.library.custom_op("vllm_bdlora::fused_lora_slices_", mutates_args=("output",))
def fused_lora_slices_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    slot_widths: torch.Tensor,
    token_slots: torch.Tensor,
    offsets: list[int],
    scale_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """In place on output (tokens, sum of slice heights): for each slice i, the columns from offsets[i] get
    the LoRA delta of each token's slot, A = lora_a[i] (slots, width, in), B = lora_b[i] (slots, height,
    width), using the first slot_widths[i, slot] columns (vLLM has folded the scaling into B); with
    scale_table (slots, total height) the DoRA compose instead. Token slot -1: untouched."""
    from vllm_bdlora.kernels.reference import fused_expand_reference, lora_shrink_reference

    slots = token_slots[: x.shape[0]]
    ones = torch.ones(lora_a[0].shape[0], dtype=torch.float32, device=x.device)
    routing = route_tokens(slots, lora_a[0].shape[0], 16 if x.shape[0] <= 64 else 64) if x.is_cuda else None
    for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
        columns = slice(offsets[i], offsets[i] + b.shape[1])
        table = scale_table[:, columns] if scale_table is not None else None
        bias_i = bias[columns] if bias is not None else None
        if x.is_cuda:
            shrunk = lora_shrink(x, a, routing, slot_widths[i])
            fused_expand(output[:, columns], shrunk, b, routing, slot_widths[i], ones, table, bias_i)
        else:
            shrunk = lora_shrink_reference(x, a, slots, slot_widths[i])
            output[:, columns] = fused_expand_reference(output[:, columns], shrunk, b, slots, slot_widths[i], ones,
                                                        table, bias_i)  # fmt: skip


@fused_lora_slices_.register_fake
def _(output, x, lora_a, lora_b, slot_widths, token_slots, offsets, scale_table=None, bias=None) -> None:
    return None

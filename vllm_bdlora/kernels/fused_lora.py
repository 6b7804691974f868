"""Routed multi-LoRA kernels for batches of any size (LoRAFusion-style split graph, tile-level adapter routing).

Tokens are grouped by LoRA slot in the layout of vLLM's `LoRAKernelMeta` (`TokenGroups`): vLLM already
builds that once per step for its own kernels, so the layers reuse it and route nothing per call. Each
program takes one (group, block of BLOCK_M tokens) tile, so every tile reads a single adapter's weights;
base-model tokens (slot -1) are their own group. A per-slice, per-slot width table bounds every rank loop
by the adapter's real rank (heterogeneous ranks in one batch), and an optional per-slot table gives
DoRA's magnitude scale.

All slices of a packed layer (q/k/v, gate/up) go through one launch per kernel: the layer keeps its LoRA
weights in one buffer per kind, A (slots, slices·width, in) and B (slots, total height, width), whose
per-slice views are what vLLM sees.

* `lora_shrink`        S = X·A[slot]ᵀ per token, all slices at once, float32. With split_k > 1 the hidden
                       dimension is cut into split_k parts written side by side (no atomics, no zero fill);
                       the consumer sums them, so decode-sized batches still spread over many programs.
* `fused_expand`       y = y + S·B[slot]ᵀ in place, or the DoRA compose of y and that delta, one pass over y;
                       base-model tokens are never touched.
* `delta_then_gemm`    out = S·B[slot]ᵀ (+ bias) written by the expand, then cuBLAS accumulates X·Wᵀ onto it
                       (beta = 1): the output is never re-read by a pass of its own.

Every launch takes a `plans.LaunchConfig` (the layer op reads them from the GPU's plan table); `reference.py`
holds the per-slice contracts (`lora_shrink_reference`, `fused_expand_reference`). Launches never sync with the
host and size their grids from the token count only, so they are CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels.compile_ahead import launch
from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2
from vllm_bdlora.kernels.plans import LaunchConfig


@dataclass(frozen=True)
class TokenGroups:
    """Tokens grouped by slot, as vLLM's LoRAKernelMeta holds them (the layers pass vLLM's tensors)."""

    sorted_ids: torch.Tensor  # (>= tokens,) int32: token indices, grouped by slot
    group_slot: torch.Tensor  # (groups,) int32: slot of each group, -1 base-model tokens (or unused group)
    group_count: torch.Tensor  # (groups,) int32: tokens in each group, 0 for unused groups
    group_start: torch.Tensor  # (>= groups,) int32: first position of each group in sorted_ids


def group_tokens(token_slots: torch.Tensor, num_slots: int) -> TokenGroups:
    """TokenGroups for `token_slots` (slot per token, -1 none) with torch ops only: no host sync and
    static shapes. Group 0 holds base-model tokens, group 1 + s slot s (empty groups have count 0)."""
    group = (token_slots.long() + 1).clamp(min=0)
    sorted_ids = torch.argsort(group, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=token_slots.device)
    counts.scatter_add_(0, group, torch.ones_like(group))
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(-1, num_slots, dtype=torch.int32, device=token_slots.device)
    return TokenGroups(sorted_ids, slots, counts.int(), starts.int())


# The expand's rank steps per slice that compile inline; wider adapters loop over their own width instead.
# Inline, a layer's expand carries slices x steps x split_k loads of S: at width 512 (32-wide steps, split_k 16)
# its slowest variant took 31-35 s to compile and a TP=1 server's first start 201 s in all
# (archived CPU runs); looped, 43.5 s; on an H200 at width 512 the unrolled expand took 0.98-1.11x
# the looped one's time at 1024-8192 tokens (archived H200 runs). Widths up to 128 at BLOCK_K 32 (every BD
# r' <= 512 from TP=4 on) unroll.
UNROLLED_WIDTH_STEPS = 4


def unrolls_width(width: int, block_k: int) -> bool:
    return cdiv(width, block_k) <= UNROLLED_WIDTH_STEPS


@triton.jit
def _group_tile(sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr, group, m_block,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """Slot of the group, and the token rows of its m_block-th tile (row_ok false past the group)."""
    slot = tl.load(group_slot_ptr + group)
    count = tl.load(group_count_ptr + group)
    offs = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs < count
    rows = tl.load(sorted_ids_ptr + tl.load(group_start_ptr + group) + offs, mask=row_ok, other=0).to(tl.int64)
    return slot, count, rows, row_ok


@triton.jit
def _rows_dot(acc, x_ptr, m_ptr, rows, cols, k_lo, k_hi, stride_x, stride_m, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):  # fmt: skip
    """acc += X[rows, k_lo:k_hi]·M[cols, k_lo:k_hi]ᵀ (X·Aᵀ in the shrink, X·Wᵀ in the GEMM). rows and cols
    must be valid indices (callers point padding lanes at real rows/columns and mask only the store), so
    with EVEN_K (every [k_lo, k_hi) a whole number of BLOCK_K) no load is masked."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
        m_ptrs = m_ptr + cols[None, :] * stride_m + ks[:, None]
        if EVEN_K:
            x = tl.load(x_ptrs)
            m = tl.load(m_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(ks < k_hi)[None, :], other=0.0)
            m = tl.load(m_ptrs, mask=(ks < k_hi)[:, None], other=0.0)
        acc += tl.dot(x, m)
    return acc


@triton.jit
def _slice_step(
    acc, s_ptr, b_ptr, rows, cols, k0, j, w, lo, hi, n0, stride_split, stride_s, stride_bn,
    SPLIT_K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_W: tl.constexpr,
):  # fmt: skip
    """acc += S_j[rows, k0:k0 + BLOCK_K]·B[cols, k0:k0 + BLOCK_K]ᵀ, S's columns at or past w zeroed."""
    ks = k0 + tl.arange(0, BLOCK_K)
    s_offs = rows[:, None] * stride_s + j * WIDTH + ks[None, :]
    if EVEN_W:
        s = tl.load(s_ptr + s_offs)
        for part in tl.static_range(1, SPLIT_K):
            s += tl.load(s_ptr + part * stride_split + s_offs)
    else:
        s = tl.load(s_ptr + s_offs, mask=(ks < WIDTH)[None, :], other=0.0)
        for part in tl.static_range(1, SPLIT_K):
            s += tl.load(s_ptr + part * stride_split + s_offs, mask=(ks < WIDTH)[None, :], other=0.0)
    s = tl.where((ks < w)[None, :], s, 0.0)
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None]
    if EVEN_W & (n0 >= lo) & (n0 + BLOCK_N <= hi):
        b = tl.load(b_ptrs)
    else:
        b_mask = ((cols >= lo) & (cols < hi))[None, :] & (ks < WIDTH)[:, None]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    return acc + tl.dot(s.to(b.dtype), b)


@triton.jit
def _slices_delta(
    acc, s_ptr, b_ptr, widths_ptr, bounds_ptr, slot, rows, cols, n0, stride_split, stride_s, stride_bn, stride_w,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_W: tl.constexpr, UNROLL_W: tl.constexpr,
):  # fmt: skip
    """acc += S_j[rows, :w]·B[slot, cols, :w]ᵀ for each slice j the column block [n0, n0 + BLOCK_N)
    meets, w = the slot's width in slice j (summing S's split_k parts as it loads them). rows and cols
    are valid indices; S beyond w (never written) is zeroed after loading, and B is only masked in a
    column block that straddles two slices (or, unless EVEN_W, where BLOCK_K passes the buffer width).
    UNROLL_W (`unrolls_width`): the rank steps inline over the whole buffer width, else a loop up to w."""
    for j in tl.static_range(NUM_SLICES):
        lo = tl.load(bounds_ptr + j)
        hi = tl.load(bounds_ptr + j + 1)
        w = tl.load(widths_ptr + j * stride_w + slot)
        if (n0 < hi) & (n0 + BLOCK_N > lo) & (w > 0):
            if UNROLL_W:
                for k0 in tl.static_range(0, WIDTH, BLOCK_K):
                    acc = _slice_step(acc, s_ptr, b_ptr, rows, cols, k0, j, w, lo, hi, n0, stride_split, stride_s,
                                      stride_bn, SPLIT_K, WIDTH, BLOCK_N, BLOCK_K, EVEN_W)  # fmt: skip
            else:
                for k0 in range(0, w, BLOCK_K):
                    acc = _slice_step(acc, s_ptr, b_ptr, rows, cols, k0, j, w, lo, hi, n0, stride_split, stride_s,
                                      stride_bn, SPLIT_K, WIDTH, BLOCK_N, BLOCK_K, EVEN_W)  # fmt: skip
    return acc


@triton.jit
def _compose_and_store(out_ptr, base, delta, g, rows, mask, cols, stride_out, bias_ptr, col_ok,
                       HAS_DORA: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """out = base + delta, or DoRA's compose g·(base - bias + delta) + bias written as base + ((g - 1)·(base -
    bias) + g·delta): g is the magnitude scale of each element's adapter (1 on base-model rows)."""
    if HAS_DORA:
        unbiased = base
        if HAS_BIAS:
            unbiased = base - tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = base + ((g - 1.0) * unbiased + g * delta)
    else:
        y = base + delta
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_delta(out_ptr, delta, rows, row_ok, cols, col_ok, stride_out, bias_ptr, HAS_BIAS: tl.constexpr):
    """out = delta (+ bias): what the base GEMM then accumulates onto (fused_expand's overwrite mode)."""
    if HAS_BIAS:
        delta += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], delta.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _routed_shrink_kernel(
    x_ptr, a_ptr, s_ptr, sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr, widths_ptr,
    hidden, total_width, width, k_per_split, stride_x, stride_al, stride_ar, stride_split, stride_s, stride_w,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    group = tl.program_id(1)
    slot, count, rows, row_ok = _group_tile(sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr,
                                            group, m_block, BLOCK_M)  # fmt: skip
    if (slot < 0) | (m_block * BLOCK_M >= count):
        return
    r_block = tl.program_id(2) // SPLIT_K
    part = tl.program_id(2) % SPLIT_K
    rs = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rs < total_width
    slot_width = tl.load(widths_ptr + (rs // width) * stride_w + slot, mask=in_range, other=0)
    r_ok = in_range & (rs % width < slot_width)
    if tl.sum(r_ok.to(tl.int32), 0) == 0:
        return
    k_lo = part * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc = _rows_dot(acc, x_ptr, a_ptr + slot * stride_al, rows, rs % total_width, k_lo,
                    tl.minimum(k_lo + k_per_split, hidden), stride_x, stride_ar, BLOCK_K, EVEN_K)  # fmt: skip
    out = s_ptr + part * stride_split + rows[:, None] * stride_s + rs[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & r_ok[None, :])


# n_rows (the batch's token count) only bounds masks: not specialised on, so a new batch size never compiles
# a new variant (token-count dependent ints that address memory stay specialised: Triton's alignment hints
# keep the loads vectorised; launch configurations and split_k are constexpr, compiled by `warm_up`).
@triton.jit(do_not_specialize=["n_rows"])
def _fused_expand_kernel(
    y_ptr, s_ptr, b_ptr, sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr, widths_ptr,
    bounds_ptr, scale_ptr, g_ptr, bias_ptr, n_rows, n_cols, n_groups,
    stride_y, stride_split, stride_s, stride_bl, stride_bn, stride_w, stride_g,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, OVERWRITE: tl.constexpr, MAX_GROUPS: tl.constexpr, WIDTH: tl.constexpr,
    EVEN_W: tl.constexpr, UNROLL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    group = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    if OVERWRITE:
        if group == n_groups:
            # Rows no group holds (CUDA-graph padding past the step's tokens, which come first): they
            # still get a defined value, the bias, before the base GEMM accumulates onto them.
            groups = tl.arange(0, MAX_GROUPS)
            grouped = tl.sum(tl.load(group_count_ptr + groups, mask=groups < n_groups, other=0), 0)
            rows = grouped + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            if grouped + m_block * BLOCK_M < n_rows:
                _store_delta(y_ptr, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), rows.to(tl.int64), row_ok,
                             cols, col_ok, stride_y, bias_ptr, HAS_BIAS)  # fmt: skip
            return
    slot, count, rows, row_ok = _group_tile(sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr,
                                            group, m_block, BLOCK_M)  # fmt: skip
    if m_block * BLOCK_M >= count:
        return
    if slot < 0:
        if OVERWRITE:  # base-model tokens: no delta
            _store_delta(y_ptr, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), rows, row_ok, cols, col_ok,
                         stride_y, bias_ptr, HAS_BIAS)  # fmt: skip
        return
    valid_cols = cols % n_cols  # lanes past the last column read a real one; only the store is masked
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    delta = _slices_delta(delta, s_ptr, b_ptr + slot * stride_bl, widths_ptr, bounds_ptr, slot, rows, valid_cols, n0,
                          stride_split, stride_s, stride_bn, stride_w, NUM_SLICES, SPLIT_K, WIDTH, BLOCK_N, BLOCK_K,
                          EVEN_W, UNROLL_W)  # fmt: skip
    if HAS_SCALE:
        delta = delta * tl.load(scale_ptr + slot)
    if OVERWRITE:
        _store_delta(y_ptr, delta, rows, row_ok, cols, col_ok, stride_y, bias_ptr, HAS_BIAS)
        return
    base = tl.load(y_ptr + rows[:, None] * stride_y + valid_cols[None, :]).to(tl.float32)
    g = 1.0
    if HAS_DORA:
        g = tl.load(g_ptr + slot * stride_g + cols, mask=col_ok, other=1.0)[None, :]
    _compose_and_store(y_ptr, base, delta, g, rows, row_ok[:, None] & col_ok[None, :], cols, stride_y, bias_ptr,
                       col_ok, HAS_DORA, HAS_BIAS)  # fmt: skip


# Mixed tiles: a batch of 64 tokens over a dozen adapters leaves each adapter a few rows, and one tile per adapter
# launches three times the tiles of a one-adapter batch, each of a few live rows. A mixed tile covers block_m
# consecutive positions of the grouped order whatever adapters they belong to, and adds each adapter's delta to its
# own rows (a dot over the whole tile per adapter, kept where the row is the adapter's), so a batch launches as many
# tiles whatever it mixes; but the tile's adapters take turns. Measured on an H200 (TP=4 shapes, BD r'=32, 12
# slots; results/kernels/mixed-tiles-tp4-h200): where a tile holds many adapters the turns cost more than the tiles
# saved (16 tokens over 12 adapters: 1.7-3.7x the per-adapter tiles' time), while for o_proj and down_proj at 33-64
# tokens the plan search chose them, with their shrinks (the whole layer 5-8% faster at 1 and 4 adapters, 1.5-4% at
# 12). So they are a plan-table choice, off by default. Tried: each row gathering its own adapter's B instead of
# turns (as the one-launch kernel's finish does, decode_lora._rows_delta): flat in adapters, but at best twice the
# per-adapter tiles' time per projection on an H200 and never chosen by the search
# (results/kernels/mixed-tiles-tp4-h200/row-gather).
@triton.jit(do_not_specialize=["n_rows"])
def _mixed_tiles_expand_kernel(
    y_ptr, s_ptr, b_ptr, sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr, widths_ptr,
    bounds_ptr, scale_ptr, g_ptr, bias_ptr, n_rows, n_cols, n_groups,
    stride_y, stride_split, stride_s, stride_bl, stride_bn, stride_w, stride_g,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, OVERWRITE: tl.constexpr, MAX_GROUPS: tl.constexpr, WIDTH: tl.constexpr,
    EVEN_W: tl.constexpr, UNROLL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    positions = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= n_rows:
        return
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    valid_cols = cols % n_cols  # lanes past the last column read a real one; only the store is masked
    # Each position's group: the one whose [start, start + count) holds it (none past the grouped tokens, where
    # CUDA-graph padding rows follow in token order: their row is their position).
    groups = tl.arange(0, MAX_GROUPS)
    group_ok = groups < n_groups
    starts = tl.load(group_start_ptr + groups, mask=group_ok, other=0)
    counts = tl.load(group_count_ptr + groups, mask=group_ok, other=0)
    slots = tl.load(group_slot_ptr + groups, mask=group_ok, other=-1)
    member = (positions[:, None] >= starts[None, :]) & (positions[:, None] < (starts + counts)[None, :])
    grouped = tl.sum(member.to(tl.int32), 1) > 0
    row_group = tl.sum(tl.where(member, groups[None, :], 0), 1)
    row_slot = tl.sum(tl.where(member, slots[None, :], 0), 1)
    adapted = grouped & (row_slot >= 0)
    in_batch = positions < n_rows
    rows = tl.load(sorted_ids_ptr + positions, mask=grouped, other=0)
    rows = tl.where(grouped, rows, tl.where(in_batch, positions, 0)).to(tl.int64)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_tile = tl.full((BLOCK_M, BLOCK_N), 1.0, dtype=tl.float32)
    first = tl.min(tl.where(adapted, row_group, MAX_GROUPS), 0)
    last = tl.max(tl.where(adapted, row_group, -1), 0)
    for group in range(first, last + 1):  # the tile's groups are consecutive: positions run in group order
        slot = tl.load(group_slot_ptr + group)
        if (slot >= 0) & (tl.load(group_count_ptr + group) > 0):
            mine = (adapted & (row_group == group))[:, None]
            part = _slices_delta(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), s_ptr, b_ptr + slot * stride_bl,
                                 widths_ptr, bounds_ptr, slot, rows, valid_cols, n0, stride_split, stride_s,
                                 stride_bn, stride_w, NUM_SLICES, SPLIT_K, WIDTH, BLOCK_N, BLOCK_K, EVEN_W,
                                 UNROLL_W)  # fmt: skip
            if HAS_SCALE:
                part = part * tl.load(scale_ptr + slot)
            delta = tl.where(mine, part, delta)  # other rows' S (another adapter's, or unwritten) is dropped here
            if HAS_DORA:
                g = tl.load(g_ptr + slot * stride_g + cols, mask=col_ok, other=1.0)
                g_tile = tl.where(mine, g[None, :], g_tile)
    if OVERWRITE:  # every row of the batch: the delta + bias (bias alone for base-model and padding rows)
        _store_delta(y_ptr, delta, rows, in_batch, cols, col_ok, stride_y, bias_ptr, HAS_BIAS)
        return
    if last >= 0:  # base-model rows stay untouched: a tile of those alone reads nothing
        base = tl.load(y_ptr + rows[:, None] * stride_y + valid_cols[None, :]).to(tl.float32)
        _compose_and_store(y_ptr, base, delta, g_tile, rows, adapted[:, None] & col_ok[None, :], cols, stride_y,
                           bias_ptr, col_ok, HAS_DORA, HAS_BIAS)  # fmt: skip


def _rows_major(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"fused LoRA kernels need unit stride in the last dimension, got shape {tuple(t.shape)}")


def _groups_grid(groups: TokenGroups, tokens: int, block_m: int, blocks: int) -> tuple[int, int, int]:
    return cdiv(max(tokens, 1), block_m), groups.group_slot.shape[0], blocks


def split_parts(split_k: int, tokens: int, total_width: int, device) -> torch.Tensor:
    """An empty S (split_k, tokens, total_width) float32 whose parts start 16 elements apart or a multiple of it.
    Triton specialises an integer argument on its divisibility by 16, and the part stride is one: contiguous, it
    is tokens x total_width, whose divisibility changed with the token count's parity at total widths of 8 or 24
    (BD-LoRA at TP=4, r'=32), so a step of an odd token count compiled a second variant of both kernels while
    serving, seconds after warm-up had compiled the first."""
    part = cdiv(max(tokens, 1) * total_width, 16) * 16
    parts = torch.empty(split_k * part, dtype=torch.float32, device=device)
    return parts.as_strided((split_k, tokens, total_width), (part, total_width, 1))


def lora_shrink(x, lora_a, groups: TokenGroups, slot_widths, config: LaunchConfig) -> torch.Tensor:
    """S (split_k, tokens, slices·width) float32: X·A[slot]ᵀ per token, lora_a (slots, slices·width, hidden),
    slot_widths (slices, slots) int32. Only columns below each slot's width are written; the split_k parts
    sum to S."""
    _rows_major(x, lora_a)
    slices, total_width = slot_widths.shape[0], lora_a.shape[1]
    cfg = config
    k_per_split = cdiv(cdiv(x.shape[1], cfg.split_k), cfg.block_k) * cfg.block_k
    out = split_parts(cfg.split_k, x.shape[0], total_width, x.device)
    grid = _groups_grid(groups, x.shape[0], cfg.block_m, cdiv(total_width, cfg.block_n) * cfg.split_k)
    launch(_routed_shrink_kernel, grid,
        x, lora_a, out, groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start, slot_widths,
        x.shape[1], total_width, total_width // slices, k_per_split, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), out.stride(0), out.stride(1), slot_widths.stride(0),
        SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=x.shape[1] % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _optional(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    return t if t is not None else stand_in  # Triton needs a pointer; the kernel never reads it


def fused_expand(
    y, shrunk, lora_b, groups, slot_widths, slice_bounds, slot_scales=None, scale_table=None, bias=None,
    config: LaunchConfig | None = None, overwrite: bool = False,
):  # fmt: skip
    """In place on y (tokens, total height): y += S·B[slot]ᵀ per token (times slot_scales[slot] if given),
    or the DoRA compose with `scale_table` (slots, total height). lora_b (slots, total height, width);
    slice j owns columns slice_bounds[j]:slice_bounds[j+1] and S's columns j·width:(j+1)·width.
    overwrite: y's contents are ignored and every row is written: the delta + bias (bias alone for
    base-model tokens and rows in no group), for a base GEMM to accumulate onto (`delta_then_gemm`)."""
    _rows_major(y, shrunk, lora_b)
    if overwrite and scale_table is not None:
        raise ValueError("the DoRA compose needs the base output: overwrite=False")
    width = lora_b.shape[2]
    if config is None:
        raise TypeError("fused_expand needs its launch configuration (plans.launch_for)")
    cfg = config
    n_groups = groups.group_slot.shape[0]
    if cfg.mixed_tiles:
        kernel, grid = (
            _mixed_tiles_expand_kernel,
            (cdiv(max(y.shape[0], 1), cfg.block_m), cdiv(y.shape[1], cfg.block_n)),
        )
    else:
        kernel, grid = (
            _fused_expand_kernel,
            _groups_grid(groups, y.shape[0], cfg.block_m, cdiv(y.shape[1], cfg.block_n)),
        )
        if overwrite:
            grid = (grid[0], n_groups + 1, grid[2])  # the extra group: rows past the grouped tokens
    launch(kernel, grid,
        y, shrunk, lora_b, groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start,
        slot_widths, slice_bounds, _optional(slot_scales, slice_bounds), _optional(scale_table, slice_bounds),
        _optional(bias, slice_bounds), y.shape[0], y.shape[1], n_groups, y.stride(0), shrunk.stride(0),
        shrunk.stride(1), lora_b.stride(0), lora_b.stride(1), slot_widths.stride(0),
        scale_table.stride(0) if scale_table is not None else 0,
        NUM_SLICES=slot_widths.shape[0], SPLIT_K=shrunk.shape[0], HAS_SCALE=slot_scales is not None,
        HAS_DORA=scale_table is not None, HAS_BIAS=bias is not None, OVERWRITE=overwrite,
        MAX_GROUPS=next_power_of_2(n_groups), WIDTH=width, EVEN_W=width % cfg.block_k == 0,
        UNROLL_W=unrolls_width(width, cfg.block_k), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def delta_then_gemm(
    x, weight, shrunk, lora_b, groups, slot_widths, slice_bounds, slot_scales=None, bias=None, out=None,
    config: LaunchConfig | None = None,
):  # fmt: skip
    """out = X·Wᵀ (+ bias) + S·B[slot]ᵀ per token: the fused expand writes delta + bias into out (a write
    only pass), then cuBLAS accumulates X·Wᵀ onto it (beta = 1), reading out in the GEMM's epilogue while the
    GEMM is busy computing. vLLM's order (GEMM, then an expand that re-reads and re-writes the whole output)
    moves the same bytes but in a memory-bound pass of its own."""
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    fused_expand(out, shrunk, lora_b, groups, slot_widths, slice_bounds, slot_scales, None, bias, config, True)
    return out.addmm_(x, weight.t())

"""Fused multi-LoRA kernels (LoRAFusion-style split graph) with tile-level adapter routing.

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
* `fused_lora_linear`  out = X·Wᵀ (+ bias) + S·B[slot]ᵀ in one GEMM whose accumulator also takes the LoRA
                       term: the output is written once (no expand pass re-reading and re-writing it).

`reference.py` holds the per-slice contracts (`lora_shrink_reference`, `fused_expand_reference`,
`fused_lora_linear_reference`). Launches never sync with the host and size their grids from the token
count only, so they are CUDA-graph safe. `fused_lora_slices_` (custom op
`torch.ops.vllm_bdlora.fused_lora_slices_`) is what BD layers call on CUDA under the default
`lora_kernels: "auto"`, and everywhere under `"fused"`; CPU tensors take the torch references. Given the
layer's decode state, it hands decode-sized batches over an unquantized base to `decode_lora` (one kernel).

Measured on an H200 at Llama-3.1-8B TP=4 shapes (archived H200 runs): the layer
op is 1.10-2.07× faster than vLLM's GEMM + shrink + expand at 1-64 tokens in every layer kind, 1.47-1.68×
(qkv), 1.13-1.21× (gate_up) and 0.97-1.07× (o, down) at 1024-8192 tokens. The split-graph Triton GEMM loses
to cuBLAS at prefill, so the layers do not use it.

Every launch configuration and split_k is a constexpr: `warm_up` compiles each variant a layer can launch on
its first call, so serving never compiles one for a new batch size.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels import decode_lora
from vllm_bdlora.kernels.compile_ahead import compile_concurrently, compile_threads, launch
from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2
from vllm_bdlora.kernels.op_library import define_op
from vllm_bdlora.kernels.triton_cache import CACHE_DIR_ENV, plugin_cache_dir

logger = logging.getLogger("vllm.bdlora")


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


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Launch configurations and the delta-first threshold below were chosen from launch-configuration sweeps
# on an H200 at Llama-3.1-8B TP=4 shapes (bench/kernels/lora_breakdown.py --configs; results in
# archived H200 runs).


def all_slices_block(width: int, slices: int) -> int:
    """The shrink's column block that covers every slice's ranks at once (up to 128 columns): X read once."""
    return min(128, next_power_of_2(width * slices))


def decode_shrink_parts(hidden: int, width: int) -> int:
    """How many parts the shrink cuts the hidden dimension into at decode sizes: the power of two nearest
    sqrt(hidden / width) (the lower one at a tie), 1 to 16, each part at least 64 features. More parts spread
    the A reads over more SMs, but each expand program then reads every part of its rows' S (parts x width
    floats per row), so the best split falls as the width grows: the shrink + expand pair timed at every split
    (archived H200 runs) took 1.02x the best split's time in all with this rule, worst case 1.14x,
    against 1.36x and 2.79x (gate_up_proj at width 512, 16 tokens, 4 adapters: 16 parts) with the earlier
    fixed 16 (8 from 17 tokens)."""
    parts = 1
    while parts < 16 and (2 * parts) ** 2 * width < 2 * hidden:
        parts *= 2
    return max(1, min(parts, hidden // 64))


def shrink_hidden_step(hidden: int, parts: int) -> int:
    """The decode shrink's step over the hidden dimension: 128 deep where a part is that long, else 64."""
    return 128 if hidden // parts >= 128 else 64


# From this many tokens the expand takes 128 x 256 tiles and the shrink splits the hidden dimension only as far
# as the S re-reads those tiles make allow (`shrink_config`, `expand_config`; found with an H100's sweeps). On an
# H200, Llama-3.1-8B shapes, the LoRA time the layer op adds to the base GEMMs of a decoder layer at 1024 / 4096
# tokens fell from 352 to 160 / 549 to 464 us at TP=1 (BD r'=128), 537 to 401 / 1262 to 1199 at TP=1 (r'=512), 146
# to 96 / 266 to 250 at TP=2, 70 to 61 / level at TP=4 (archived H100 runs, archived H200 runs). Smaller
# batches keep the earlier tiles: with 128 x 256 tiles a 128-token batch would have a few programs.
PREFILL_TILE_MIN_TOKENS = 1024
_PREFILL_EXPAND_BLOCK_N = 256
_NARROW_EXPAND_MIN_TOKENS = 4096
# Each expand program reads its rows' S (split_k parts x the slice's width, float32) once per column block: the
# shrink's split is capped so that costs at most this many bytes per token (gate_up_proj at TP=1 re-read 470 MB
# of S at 1024 tokens with 8 parts).
_S_REREAD_BYTES_PER_TOKEN = 32 * 1024


# Cached: every BD layer asks on every call outside CUDA graphs (eager prefills), with the same few layer shapes
# and the step's token count, so all but one layer's ask is a lookup (2 and 1 us of Python a call otherwise,
# archived CPU runs).
@functools.lru_cache(maxsize=4096)
def shrink_config(tokens: int, hidden: int, width: int, slices: int = 1,
                  out_features: int | None = None) -> LaunchConfig:  # fmt: skip
    """Decode-sized batches: a column block per slice and the hidden dimension cut into `decode_shrink_parts`,
    so the A reads spread over the SMs. Larger ones: one column block for all slices where they fit (X read
    once), the hidden dimension cut until the grid has some 256 programs (a power of two parts, so few kernel
    variants exist to compile); from PREFILL_TILE_MIN_TOKENS, with the layer's `out_features` known, into no more
    parts than the expand's re-reads of S allow, and where that leaves 1 or 2 parts, 64-deep steps 4 stages deep
    (each program's hidden loop is long)."""
    if tokens <= 64:
        parts = decode_shrink_parts(hidden, width)
        per_slice = 16 if width <= 16 else 32 if width <= 32 else 64
        return LaunchConfig(16, per_slice, shrink_hidden_step(hidden, parts), split_k=parts)
    whole = all_slices_block(width, slices)
    tiles = cdiv(tokens, 64) * cdiv(width * slices, whole)
    parts = max(1, min(8, hidden // 256, 256 // tiles))
    prefill = tokens >= PREFILL_TILE_MIN_TOKENS
    if prefill and out_features:
        reread = cdiv(out_features, _PREFILL_EXPAND_BLOCK_N) * width * 4  # bytes per token and part
        parts = max(1, min(parts, _S_REREAD_BYTES_PER_TOKEN // reread))
    parts = 1 << (parts.bit_length() - 1)
    if prefill and parts <= 2:
        return LaunchConfig(64, whole, 64, split_k=parts, num_stages=4)
    return LaunchConfig(64, whole, 128, split_k=parts)


@functools.lru_cache(maxsize=4096)
def expand_config(tokens: int, width: int, slices: int = 1) -> LaunchConfig:
    """Decode-sized batches: 16 x 64 tiles; up to PREFILL_TILE_MIN_TOKENS 64 x 64; from there 128 x 256 tiles over
    8 warps, which re-read S and B a quarter as often (adapters 256 or wider step 64 deep over their width, 3
    stages: gate_up_proj at TP=1, r'=512, 1024 tokens: 568 -> 546 us). Adapters narrower than 64 (r'=128 from TP=4
    on) go back to 64-128 x 128 tiles from _NARROW_EXPAND_MIN_TOKENS, where S is small and the expand streams the
    output: 128 x 256 tiles cost 1-9 us more per projection at 4096 tokens (archived H100 runs)."""
    block_k = 16 if width <= 16 else 32
    if tokens <= 64:
        return LaunchConfig(16, 64, block_k, num_stages=2)
    if tokens < PREFILL_TILE_MIN_TOKENS:
        return LaunchConfig(64, 64, block_k, num_stages=1)
    if width < 64 and tokens >= _NARROW_EXPAND_MIN_TOKENS:
        return LaunchConfig(128 if slices > 1 else 64, 128, block_k, num_stages=1)
    if width >= 256:
        return LaunchConfig(128, _PREFILL_EXPAND_BLOCK_N, 64, num_warps=8, num_stages=3)
    return LaunchConfig(128, _PREFILL_EXPAND_BLOCK_N, block_k, num_warps=8, num_stages=2)


# From this many tokens packed layers (several slices) let the base GEMM accumulate onto the delta
# (delta_then_gemm) rather than the expand add to the GEMM's output: writing the delta saves reading the
# output, but cuBLAS with beta = 1 picks slower kernels for some shapes. Measured: 1-3% faster for qkv and
# gate_up from 2048 tokens, a wash (±2%) for o and down, slower below 2048 tokens.
DELTA_FIRST_MIN_TOKENS = 2048


def writes_delta_first(delta_first_layer: bool, tokens: int) -> bool:
    """Whether the layer op runs `delta_then_gemm` for a batch of `tokens`: packed, non-DoRA layers over an
    unquantized base (`delta_first_layer`) from DELTA_FIRST_MIN_TOKENS tokens. The op and the warm-up's
    launch list both ask here, so the warm-up compiles exactly the expand variants the op will launch."""
    return delta_first_layer and tokens >= DELTA_FIRST_MIN_TOKENS


# The expand's rank steps per slice that compile inline; wider adapters loop over their own width instead.
# Inline, a layer's expand carries slices x steps x split_k loads of S: at width 512 (32-wide steps, split_k 16)
# its slowest variant took 31-35 s to compile and a TP=1 server's first start 201 s in all
# (archived CPU runs); looped, 43.5 s; on an H200 at width 512 the unrolled expand took 0.98-1.11x
# the looped one's time at 1024-8192 tokens (archived H200 runs). Widths up to 128 at BLOCK_K 32 (every BD
# r' <= 512 from TP=4 on) unroll.
UNROLLED_WIDTH_STEPS = 4


def unrolls_width(width: int, block_k: int) -> bool:
    return cdiv(width, block_k) <= UNROLLED_WIDTH_STEPS


def linear_config(tokens: int) -> LaunchConfig:
    if tokens <= 64:
        return LaunchConfig(16, 32, 128, num_stages=4)
    return LaunchConfig(64 if tokens < 1024 else 128, 128, 64, num_warps=8, num_stages=3)


def launch_variants(hidden: int, width: int, slices: int, out_features: int, delta_first: bool,
                    max_tokens: int = 1 << 16):  # fmt: skip
    """Every launch the layer op can make for 1..max_tokens tokens: (shrink configuration) and (expand
    configuration, shrink's split_k, overwrite) sets. The configurations are constant between multiples of
    64 tokens except at the thresholds, which are multiples of 64 too, so 1..64 and 64k, 64k + 1 cover all."""
    counts = [*range(1, 65), *(t + d for t in range(128, max_tokens + 1, 64) for d in (-63, 0))]
    shrinks, expands = set(), set()
    for tokens in counts:
        shrink = shrink_config(tokens, hidden, width, slices, out_features)
        shrinks.add(shrink)
        overwrite = writes_delta_first(delta_first, tokens)
        expands.add((expand_config(tokens, width, slices), shrink.split_k, overwrite))
    return shrinks, expands


_warmed_up: set[int] = set()


def warm_up(x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias, delta_first,
            decode_weight=None) -> int:  # fmt: skip
    """Compile every kernel variant a layer of this shape can launch, on a few rows of scratch data, so
    that no batch size compiles one while serving (a compile stalls every request in the batch for about
    a second). Once per layer (keyed by its LoRA buffer), outside CUDA-graph capture; compiled variants
    are shared by layers of equal shape and cached on disk by Triton, in one directory whatever vLLM's
    configuration (triton_cache.py). The variants compile on several threads first (compile_ahead.py).
    `decode_weight`: the layer runs the one-launch decode kernel over this base weight (a variant per plan it may
    launch, `decode_lora.layer_plans`, compiled here with a scratch state). Returns the launches made."""
    if lora_a.data_ptr() in _warmed_up or torch.cuda.is_current_stream_capturing():
        return 0
    _warmed_up.add(lora_a.data_ptr())
    started = time.perf_counter()
    variants = (x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias, delta_first,
                decode_weight)  # fmt: skip
    threads = compile_threads()
    with plugin_cache_dir():
        on_threads = compile_concurrently(lambda: _compile_variants(*variants), threads)  # launches nothing
        launches = _compile_variants(*variants)
    seconds = time.perf_counter() - started
    if seconds > 1.0:  # compiled rather than found in Triton's caches: say where start-up time went
        logger.info(
            "vllm-bdlora: compiled the fused LoRA kernels for layers of %d slice(s), LoRA width %d, input %d "
            "(%d variants, %.1f s, %s); Triton caches them in %s for the next start.",
            slot_widths.shape[0], lora_b.shape[2], x.shape[1], launches, seconds,
            f"on {threads} threads" if on_threads else "one at a time",
            os.environ.get(CACHE_DIR_ENV, "its cache directory"),
        )  # fmt: skip
    return launches


def _compile_variants(x, lora_a, lora_b, slot_widths, slice_bounds, n_groups, scale_table, bias, delta_first,
                      decode_weight) -> int:  # fmt: skip
    """warm_up's launches on scratch data; returns how many."""
    rows = 16  # a multiple of 16 like most batches: the same integer specialisation as theirs
    slices, width = slot_widths.shape[0], lora_b.shape[2]
    scratch_x = x.new_zeros(rows, x.shape[1])
    scratch_y = x.new_zeros(rows, lora_b.shape[1])
    groups = group_tokens(torch.full((rows,), -1, dtype=torch.int32, device=x.device), n_groups - 1)
    shrinks, expands = launch_variants(x.shape[1], width, slices, lora_b.shape[1], delta_first)
    shrunk_by_split = {}
    for config in shrinks:
        shrunk_by_split[config.split_k] = lora_shrink(scratch_x, lora_a, groups, slot_widths, config)
    for config, split_k, overwrite in expands:  # every split_k is one of the shrinks' (launch_variants)
        fused_expand(scratch_y, shrunk_by_split[split_k], lora_b, groups, slot_widths, slice_bounds, None,
                     scale_table, bias, config, overwrite)  # fmt: skip
    launches = len(shrinks) + len(expands)
    if decode_weight is None:
        return launches
    shape = (*decode_weight.shape, lora_a.shape[1], lora_a.shape[0])  # out, hidden, LoRA width, slots
    state = decode_lora.layer_decode_state(*shape, x.device, slices)
    for tokens in decode_lora.layer_plans(*shape, x.device, slices):  # each plan's first batch launches it
        plan = decode_lora.usable_plan(tokens, *shape, x.device, state, slices)
        if plan is not None:
            decode_lora.decode_lora_linear(
                x.new_zeros(tokens, lora_b.shape[1]), x.new_zeros(tokens, x.shape[1]), decode_weight, lora_a, lora_b,
                slot_widths, slice_bounds, torch.full((tokens,), -1, dtype=torch.long, device=x.device), state, bias,
                plan,
            )  # fmt: skip
            launches += 1
    return launches


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
    _compose_and_store(y_ptr, base, delta, rows, row_ok, cols, col_ok, slot, stride_y, g_ptr, stride_g, bias_ptr,
                       HAS_DORA, HAS_BIAS)  # fmt: skip


@triton.jit
def _fused_lora_linear_kernel(
    x_ptr, w_ptr, out_ptr, s_ptr, b_ptr, sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr,
    widths_ptr, bounds_ptr, scale_ptr, g_ptr, bias_ptr, hidden, n_cols,
    stride_x, stride_w, stride_out, stride_split, stride_s, stride_bl, stride_bn, stride_wt, stride_g,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, WIDTH: tl.constexpr, EVEN_W: tl.constexpr, UNROLL_W: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    m_block = tl.program_id(0)
    slot, count, rows, row_ok = _group_tile(sorted_ids_ptr, group_slot_ptr, group_count_ptr, group_start_ptr,
                                            tl.program_id(1), m_block, BLOCK_M)  # fmt: skip
    if m_block * BLOCK_M >= count:
        return
    n0 = tl.program_id(2) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    valid_cols = cols % n_cols
    base = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    base = _rows_dot(base, x_ptr, w_ptr, rows, valid_cols, 0, hidden, stride_x, stride_w, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        base += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if slot >= 0:
        delta = _slices_delta(delta, s_ptr, b_ptr + slot * stride_bl, widths_ptr, bounds_ptr, slot, rows,
                              valid_cols, n0, stride_split, stride_s, stride_bn, stride_wt, NUM_SLICES, SPLIT_K,
                              WIDTH, BLOCK_N, BLOCK_R, EVEN_W, UNROLL_W)  # fmt: skip
        if HAS_SCALE:
            delta = delta * tl.load(scale_ptr + slot)
    _compose_and_store(out_ptr, base, delta, rows, row_ok, cols, col_ok, slot, stride_out, g_ptr, stride_g, bias_ptr,
                       HAS_DORA, HAS_BIAS)  # fmt: skip


def _rows_major(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"fused LoRA kernels need unit stride in the last dimension, got shape {tuple(t.shape)}")


def _groups_grid(groups: TokenGroups, tokens: int, block_m: int, blocks: int) -> tuple[int, int, int]:
    return cdiv(max(tokens, 1), block_m), groups.group_slot.shape[0], blocks


def lora_shrink(x, lora_a, groups: TokenGroups, slot_widths, config: LaunchConfig | None = None,
                out_features: int | None = None) -> torch.Tensor:  # fmt: skip
    """S (split_k, tokens, slices·width) float32: X·A[slot]ᵀ per token, lora_a (slots, slices·width, hidden),
    slot_widths (slices, slots) int32. Only columns below each slot's width are written; the split_k parts
    sum to S. Without `config`, `shrink_config`'s, which for large batches needs the layer's `out_features` (the
    expand's columns) to bound the split."""
    _rows_major(x, lora_a)
    slices, total_width = slot_widths.shape[0], lora_a.shape[1]
    cfg = config or shrink_config(x.shape[0], x.shape[1], total_width // slices, slices, out_features)
    k_per_split = cdiv(cdiv(x.shape[1], cfg.split_k), cfg.block_k) * cfg.block_k
    out = torch.empty(cfg.split_k, x.shape[0], total_width, dtype=torch.float32, device=x.device)
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
    cfg = config or expand_config(y.shape[0], width, slot_widths.shape[0])
    n_groups = groups.group_slot.shape[0]
    grid = _groups_grid(groups, y.shape[0], cfg.block_m, cdiv(y.shape[1], cfg.block_n))
    if overwrite:
        grid = (grid[0], n_groups + 1, grid[2])  # the extra group: rows past the grouped tokens
    launch(_fused_expand_kernel, grid,
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


def fused_lora_linear(
    x, weight, shrunk, lora_b, groups, slot_widths, slice_bounds, slot_scales=None, bias=None, scale_table=None,
    out=None, config: LaunchConfig | None = None,
):  # fmt: skip
    """out (tokens, out_features) = X·Wᵀ (+ bias) + S·B[slot]ᵀ per token (DoRA compose with `scale_table`)
    in one kernel; weight (out_features, hidden). Rows of tokens in no group (CUDA-graph padding) are not
    written."""
    _rows_major(x, weight, shrunk, lora_b)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    width = lora_b.shape[2]
    block_r = 16 if width <= 16 else 32
    cfg = config or linear_config(x.shape[0])
    grid = _groups_grid(groups, x.shape[0], cfg.block_m, cdiv(weight.shape[0], cfg.block_n))
    _fused_lora_linear_kernel[grid](
        x, weight, out, shrunk, lora_b, groups.sorted_ids, groups.group_slot, groups.group_count,
        groups.group_start, slot_widths, slice_bounds, _optional(slot_scales, slice_bounds),
        _optional(scale_table, slice_bounds), _optional(bias, slice_bounds), x.shape[1], weight.shape[0],
        x.stride(0), weight.stride(0), out.stride(0), shrunk.stride(0), shrunk.stride(1), lora_b.stride(0),
        lora_b.stride(1), slot_widths.stride(0), scale_table.stride(0) if scale_table is not None else 0,
        NUM_SLICES=slot_widths.shape[0], SPLIT_K=shrunk.shape[0], HAS_SCALE=slot_scales is not None,
        HAS_DORA=scale_table is not None, HAS_BIAS=bias is not None, WIDTH=width, EVEN_W=width % block_r == 0,
        UNROLL_W=unrolls_width(width, block_r), EVEN_K=x.shape[1] % cfg.block_k == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=block_r,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def fused_lora_slices_(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_widths: torch.Tensor,
    slice_bounds: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_ids: torch.Tensor | None = None,
    group_slot: torch.Tensor | None = None,
    group_count: torch.Tensor | None = None,
    group_start: torch.Tensor | None = None,
    no_lora: torch.Tensor | None = None,
    scale_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    decode_state: torch.Tensor | None = None,
) -> None:
    """In place on output (tokens, total height): each token's LoRA delta from its slot's adapter, all
    slices at once (lora_a (slots, slices·width, in), lora_b (slots, total height, width), the first
    slot_widths[j, slot] columns of slice j; vLLM has folded the scaling into B), or with scale_table the
    DoRA compose. Token slot -1: untouched. On CUDA the token groups (vLLM's LoRAKernelMeta tensors) are
    used; `no_lora`, a CPU flag as in vLLM's own ops, skips every LoRA launch when no token has an adapter.

    With `weight` (total height, in) the op runs the base GEMM too and output's contents are ignored:
    output = X·Wᵀ + bias + delta, in `delta_then_gemm` order for packed layers from DELTA_FIRST_MIN_TOKENS
    tokens (not for the DoRA compose, which needs the base output), else the GEMM first. With `decode_state`
    (the layer's `decode_lora.layer_decode_state`) too, batches of up to DECODE_MAX_TOKENS tokens run all of it
    as one kernel (`decode_lora.decode_lora_linear`) where the GPU has the SMs for its grid."""
    tokens = x.shape[0]
    delta_first_layer = x.is_cuda and scale_table is None and slot_widths.shape[0] > 1 and weight is not None
    # decode plans size their pipeline stages for 16-bit X and W: a float32 layer keeps the three kernels
    one_launch = decode_state is not None and weight is not None and scale_table is None and weight.element_size() == 2
    if x.is_cuda and group_slot is not None:
        warm_up(x, lora_a, lora_b, slot_widths, slice_bounds, group_slot.shape[0], scale_table, bias, delta_first_layer,
                weight if one_launch else None)  # fmt: skip
    skip_lora = no_lora is not None and bool(no_lora[0])
    if one_launch and not skip_lora:
        shape = (weight.shape[0], x.shape[1], lora_a.shape[1], lora_a.shape[0])  # out, hidden, LoRA width, slots
        plan = decode_lora.usable_plan(tokens, *shape, x.device, decode_state, slot_widths.shape[0])
        if plan is not None:
            decode_lora.decode_lora_linear(output, x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots,
                                           decode_state, bias, plan)  # fmt: skip
            return
    delta_first = writes_delta_first(delta_first_layer, tokens)
    if weight is not None and (skip_lora or not delta_first):
        torch.addmm(bias, x, weight.t(), out=output) if bias is not None else torch.mm(x, weight.t(), out=output)
        weight = None
    if skip_lora:
        return
    if x.is_cuda:
        groups = TokenGroups(sorted_ids[:tokens], group_slot, group_count, group_start)
        shrunk = lora_shrink(x, lora_a, groups, slot_widths, out_features=lora_b.shape[1])
        if weight is not None:
            delta_then_gemm(x, weight, shrunk, lora_b, groups, slot_widths, slice_bounds, bias=bias, out=output)
        else:
            fused_expand(output, shrunk, lora_b, groups, slot_widths, slice_bounds, None, scale_table, bias)
        return
    from vllm_bdlora.kernels.reference import fused_lora_slices_reference

    output.copy_(fused_lora_slices_reference(output, x, lora_a, lora_b, slot_widths, slice_bounds,
                                             token_slots[:tokens], None, scale_table, bias))  # fmt: skip


def _fused_lora_slices_fake(output, x, lora_a, lora_b, slot_widths, slice_bounds, token_slots, sorted_ids=None,
                            group_slot=None, group_count=None, group_start=None, no_lora=None, scale_table=None,
                            bias=None, weight=None, decode_state=None) -> None:  # fmt: skip
    return None


define_op("fused_lora_slices_", fused_lora_slices_, mutates_args=("output", "decode_state"),
          fake=_fused_lora_slices_fake)  # fmt: skip

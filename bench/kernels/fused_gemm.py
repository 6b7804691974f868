"""A fused GEMM candidate the layers do not use: out = X·Wᵀ (+ bias) + S·B[slot]ᵀ in one Triton GEMM whose
accumulator also takes the LoRA term, so the output is written once. Measured against the layer op's cuBLAS GEMM +
fused expand it lost at prefill sizes (bench/results/kernels/), so it lives here, beside the benchmark that
times it (`bench.kernels.fused_lora`'s "fused_linear" path); its contract is `fused_lora_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels.fused_lora import (
    _compose_and_store,
    _group_tile,
    _groups_grid,
    _optional,
    _rows_dot,
    _rows_major,
    _slices_delta,
    unrolls_width,
)
from vllm_bdlora.kernels.launch_math import cdiv
from vllm_bdlora.kernels.plans import LaunchConfig
from vllm_bdlora.kernels.reference import _compose, lora_delta_reference


def linear_config(tokens: int) -> LaunchConfig:
    if tokens <= 64:
        return LaunchConfig(16, 32, 128, num_stages=4)
    return LaunchConfig(64 if tokens < 1024 else 128, 128, 64, num_warps=8, num_stages=3)


def fused_lora_linear_reference(
    x, weight, shrunk, lora_b, token_slots, slot_ranks, slot_scales, bias=None, scale_table=None
):
    """X·Wᵀ (+ bias) and the LoRA delta in one float32 accumulation, rounded once."""
    base32 = x.float() @ weight.float().T
    if bias is not None:
        base32 = base32 + bias.float()
    delta = lora_delta_reference(shrunk, lora_b, token_slots, slot_ranks, slot_scales)
    return _compose(base32, delta, scale_table, token_slots, bias, x.dtype)


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
    g = 1.0
    if HAS_DORA:  # a base-model tile (slot -1) keeps g = 1
        g = tl.load(g_ptr + tl.maximum(slot, 0) * stride_g + cols, mask=col_ok & (cols * 0 + slot >= 0),
                    other=1.0)[None, :]  # fmt: skip
    _compose_and_store(out_ptr, base, delta, g, rows, row_ok[:, None] & col_ok[None, :], cols, stride_out, bias_ptr,
                       col_ok, HAS_DORA, HAS_BIAS)  # fmt: skip


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

"""Fused DoRA compose: one pass over the layer output that reads base, lora and the per-token magnitude
scale and writes the DoRA output.

    y[t, c] = base[t, c] + ((g - 1)·(base[t, c] - bias[c]) + g·lora[t, c]),   g = scale_table[slot[t], c]

with g = 1 for tokens whose slot is -1 (no adapter); see `reference.dora_compose_reference`, the
contract every path follows (float32 arithmetic, one rounding at the end). Bytes moved: 3·rows·cols
elements plus the g rows the batch touches.

`dora_compose_` is registered as the custom op `torch.ops.vllm_bdlora.dora_compose_` (in place on
`base`), so torch.compile treats it as one opaque call and CUDA graphs capture the kernel launch; it never
syncs with the host. CPU tensors take the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2
from vllm_bdlora.kernels.op_library import define_op
from vllm_bdlora.kernels.reference import dora_compose_reference


@triton.jit
def _dora_compose_kernel(
    base_ptr,
    lora_ptr,
    out_ptr,
    scale_ptr,
    slots_ptr,
    bias_ptr,
    n_rows,
    n_cols,
    stride_base,
    stride_lora,
    stride_out,
    stride_scale,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    adapted = (slots >= 0)[:, None] & mask
    g = tl.load(scale_ptr + tl.maximum(slots, 0)[:, None] * stride_scale + cols[None, :], mask=adapted, other=1.0)
    base = tl.load(base_ptr + rows64 * stride_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + rows64 * stride_lora + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    unbiased = base
    if HAS_BIAS:
        unbiased = base - tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = base + ((g - 1.0) * unbiased + g * lora)
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _block_sizes(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): ~4K elements per program keeps enough loads in flight to stream
    at copy bandwidth; decode-sized batches use one row per program so small batches still spread
    over the SMs."""
    block_n = min(1024, next_power_of_2(n_cols))
    block_m = 1 if n_rows <= 64 else max(1, 4096 // block_n)
    return block_m, block_n, 4


def dora_compose(
    base: torch.Tensor,
    lora: torch.Tensor,
    scale_table: torch.Tensor,
    token_slots: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel (CUDA tensors). `out` may be `base` (in place). Shapes: base, lora and
    out (rows, cols) with unit column stride; scale_table (slots, cols) float32; token_slots (rows,) int;
    bias (cols,) or None."""
    if out is None:
        out = torch.empty_like(base)
    n_rows, n_cols = base.shape
    if n_rows == 0:
        return out
    _check_layout(base, lora, out, scale_table, token_slots, bias)
    block_m, block_n, num_warps = _block_sizes(n_rows, n_cols)
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
    _dora_compose_kernel[grid](
        base,
        lora,
        out,
        scale_table,
        token_slots,
        bias if bias is not None else base,
        n_rows,
        n_cols,
        base.stride(0),
        lora.stride(0),
        out.stride(0),
        scale_table.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


def _check_layout(base, lora, out, scale_table, token_slots, bias) -> None:
    n_rows, n_cols = base.shape
    for name, t in (("base", base), ("lora", lora), ("out", out), ("scale_table", scale_table)):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"dora_compose: {name} must be 2-D with contiguous rows, got {tuple(t.shape)}")
    if lora.shape != base.shape or out.shape != base.shape or scale_table.shape[1] != n_cols:
        raise ValueError(
            f"dora_compose: base {tuple(base.shape)}, lora {tuple(lora.shape)}, out {tuple(out.shape)}, "
            f"scale_table {tuple(scale_table.shape)} do not match"
        )
    if scale_table.dtype != torch.float32:
        raise ValueError(f"dora_compose: scale_table must be float32, got {scale_table.dtype}")
    if token_slots.shape[0] < n_rows:
        raise ValueError(f"dora_compose: {token_slots.shape[0]} token slots for {n_rows} rows")
    if bias is not None and bias.shape != (n_cols,):
        raise ValueError(f"dora_compose: bias {tuple(bias.shape)} for {n_cols} columns")


def dora_compose_(
    base: torch.Tensor,
    lora: torch.Tensor,
    scale_table: torch.Tensor,
    token_slots: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """In place on `base`: the op vLLM layers call (Triton on CUDA, the torch reference elsewhere)."""
    if base.is_cuda:
        dora_compose(base, lora, scale_table, token_slots[: base.shape[0]], bias, out=base)
    else:
        base.copy_(dora_compose_reference(base, lora, scale_table, token_slots[: base.shape[0]], bias))


def _dora_compose_fake(base, lora, scale_table, token_slots, bias=None) -> None:
    return None


define_op("dora_compose_", dora_compose_, mutates_args=("base",), fake=_dora_compose_fake)

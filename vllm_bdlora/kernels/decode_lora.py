"""One-launch LoRA linear for decode-sized batches: base GEMV, LoRA shrink and expand in a single kernel.

At decode sizes each kernel of the layer op (cuBLAS GEMM, routed shrink, fused expand) costs 3-7 µs of
mostly fixed latency, so the LoRA work, a few hundred kB of A and B, costs as much as the base GEMM itself
(bench/results/kernels-h200-s8: +5.4-7.5 µs per adapted layer at 1 token). This kernel pays one launch,
with two kinds of programs running side by side:

* shrink programs (a few SMs) each compute S = X·A[slot]ᵀ over a slice of the hidden dimension, for every
  adapter of the batch (one tl.dot per adapter present, its tokens' rows), and add it into a float32 S
  buffer with atomics;
* GEMV programs (the other SMs, one per block of output columns) stream their rows of W and accumulate
  X·Wᵀ, the part that bounds the layer, while the shrink runs; then they wait at a grid-wide barrier for
  every shrink program, add S·B[slot]ᵀ (+ bias) and write the output once.

The barrier needs every program resident at once, so the grid never has more programs than the GPU has SMs
(`decode_plan` returns None otherwise, and the layer op keeps its three-kernel path). Its state lives in one
int32 tensor per layer (`new_decode_state`): one word holding the epoch (high 16 bits) and the arrivals
(low 16 bits), then two S buffers. Every program arrives (GEMV programs at their start, so that reading the
epoch and arriving is one atomic; shrink programs after their atomics); the last one resets the arrivals
and moves the epoch, and the GEMV programs spin until it moves. S buffers alternate by epoch parity, and
each launch zeroes the buffer the next launch adds into, so no launch needs a zero-fill kernel of its own
and nothing depends on the host: CUDA graphs replay it as is. Launches of one layer never overlap (one
stream), which the parity relies on.

Triton's interpreter runs programs one after another, so a spinning program would wait forever: there (and
in `phases=2`, for tests) the shrink and the rest run as two launches, the launch boundary being the barrier.
`lora_linear_slices_reference` in reference.py holds the contract. Measured on an H200 (Llama-3.1-8B shapes, BD
r'=128, bench/results/kernels-h200-s11): an adapted decoder layer's four projections take 1.11-1.13× the
base GEMMs' time at TP=4 and 1-4 tokens (three kernels: 1.61-1.62×), 1.13-1.15× at TP=2. Batches mixing
4 adapters over 4 tokens or more only break even at TP=2 and 4, and at TP=1 (widths of 128 per slice) lose
13% against the three kernels: the shrink programs run the adapters one after another.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The kernel keeps every token's rows in one 16-row tile (the smallest tl.dot); larger batches use the layer
# op's three-kernel path, whose launches amortise over the tokens.
DECODE_MAX_TOKENS = 16
_TILE_M = 16
# Wider column blocks lose to cuBLAS: gate_up_proj at TP=1 (28672 outputs, 256-column blocks to fit 132 SMs)
# ran 0.91x the three-kernel path's speed on an H200 (bench/results/kernels-h200-s11); it keeps that path.
_MAX_BLOCK_N = 128
_SHRINK_PROGRAMS_PER_SLOT, _MAX_SHRINK_PROGRAMS = 4, 32
_STATE_HEADER = 1  # one int32 word before the S buffers: epoch (high 16 bits) and arrivals (low 16 bits)


@dataclass(frozen=True)
class DecodePlan:
    block_n: int  # output columns per GEMV program
    block_k: int  # hidden step of the GEMV
    shrink_k: int  # hidden step of the shrink
    tiles: int  # GEMV programs: one per column block
    chunks: int  # shrink programs: one per slice of the hidden dimension
    k_per_chunk: int
    num_stages: int = 4

    @property
    def programs(self) -> int:
        return self.tiles + self.chunks


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache  # asked on every call of the layer op (`usable`, then the launch): a lookup after the first
def decode_plan(out_features: int, hidden: int, total_width: int, slots: int, sms: int) -> DecodePlan | None:
    """The launch for a layer of this shape with `slots` LoRA slots on a GPU with `sms` SMs, or None where the
    grid would need more programs than SMs (the barrier could then wait on a program that never runs).

    The GEMV programs take the narrowest column block that leaves 4 SMs per slot (up to 32) to the shrink:
    narrow blocks spread the weight's bytes over the most SMs. A shrink program computes every adapter of the
    batch over its slice of the hidden dimension, so a batch of 4 adapters does 4 times the work of one:
    with one slot, 4 shrink programs kept the GEMV of o_proj and down_proj at TP=4 on 128 programs (halving
    them to leave 16 cost 13-50%); with 4 slots and 4 adapters in the batch, those 4 programs left the GEMV
    waiting (down_proj at TP=1 1.8x slower than the three-kernel path), 16 about broke even
    (bench/results/kernels-h200-s11/iterations). The shrink takes the SMs left, up to 32: each partial sum is an atomic
    add on S."""
    block_n = 16
    reserve = min(_MAX_SHRINK_PROGRAMS, _SHRINK_PROGRAMS_PER_SLOT * max(1, slots))
    while triton.cdiv(out_features, block_n) + reserve > sms:
        block_n *= 2
        if block_n > _MAX_BLOCK_N:
            return None
    tiles = triton.cdiv(out_features, block_n)
    block_k = max(64, min(512, 8192 // block_n))  # some 16 kB of W per pipeline stage
    shrink_k = max(16, min(128, 8192 // triton.next_power_of_2(total_width)))
    chunks = max(1, min(_MAX_SHRINK_PROGRAMS, sms - tiles, triton.cdiv(hidden, shrink_k)))
    k_per_chunk = triton.cdiv(triton.cdiv(hidden, chunks), shrink_k) * shrink_k
    chunks = triton.cdiv(hidden, k_per_chunk)  # none without work (it would still have to arrive)
    return DecodePlan(block_n, block_k, shrink_k, tiles, chunks, k_per_chunk)


def new_decode_state(total_width: int, device) -> torch.Tensor:
    """A layer's barrier word and S buffers (int32; the S buffers are float32 bits, all zero)."""
    return torch.zeros(_STATE_HEADER + 2 * _TILE_M * total_width, dtype=torch.int32, device=device)


def usable(tokens: int, out_features: int, hidden: int, total_width: int, slots: int, device: torch.device) -> bool:
    """Whether the layer op may run this kernel for a batch of `tokens` on `device`."""
    if tokens > DECODE_MAX_TOKENS or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return decode_plan(out_features, hidden, total_width, slots, _sm_count(device.index or 0)) is not None


@triton.jit
def _arrive(state_ptr, programs):
    """Count this program in; the last one resets the count and moves the epoch, in one word so that reading
    the epoch and arriving is a single atomic. Returns the epoch this launch runs in (16 bits)."""
    old = tl.atomic_add(state_ptr, 1)  # acq_rel: this program's S atomics happen before; the last sees all
    if (old & 0xFFFF) == programs - 1:
        tl.atomic_add(state_ptr, 65536 - programs)
    return (old >> 16) & 0xFFFF


@triton.jit(do_not_specialize=["n_rows"])
def _decode_lora_linear_kernel(
    x_ptr, w_ptr, out_ptr, a_ptr, b_ptr, slots_ptr, widths_ptr, bounds_ptr, bias_ptr, state_ptr,
    n_rows, n_slots, hidden, n_cols, tiles, k_per_chunk, stride_x, stride_w, stride_out, stride_al,
    stride_ar, stride_bl, stride_bn, stride_wt,
    PHASE: tl.constexpr, NUM_SLICES: tl.constexpr, TOTAL_W: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHRINK_K: tl.constexpr,
):  # fmt: skip
    """Programs below `tiles` stream a column block of W and then add S·B[slot]ᵀ; the rest compute S. PHASE 0:
    one launch with the in-kernel barrier. PHASE 1: the shrink and every arrival only; PHASE 2: the rest,
    after a PHASE 1 launch (the launch boundary stands in for the barrier)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    s_buffers = (state_ptr + 1).to(tl.pointer_type(tl.float32))
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    safe_rows = tl.where(row_ok, rows, 0)
    row_slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)

    if pid >= tiles:  # ---- shrink: S[m, :] += X[m, k-slice]·A[slot_m, :, k-slice]ᵀ, one adapter at a time
        if PHASE == 2:
            return
        epoch = (tl.atomic_add(state_ptr, 0) >> 16) & 0xFFFF  # cannot move before this program arrives
        s_now = s_buffers + (epoch & 1) * BLOCK_M * TOTAL_W
        rs = tl.arange(0, BLOCK_R)
        if pid == tiles:  # the next launch adds into the other buffer; the previous one read it and has ended
            s_next = s_buffers + ((epoch + 1) & 1) * BLOCK_M * TOTAL_W
            tl.store(s_next + rows[:, None] * TOTAL_W + rs[None, :], tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32),
                     mask=(rs < TOTAL_W)[None, :])  # fmt: skip
        k_lo = (pid - tiles) * k_per_chunk
        k_hi = tl.minimum(k_lo + k_per_chunk, hidden)
        for slot in range(0, n_slots):
            mine = row_slots == slot
            if tl.sum(mine.to(tl.int32), 0) > 0:
                w = tl.load(widths_ptr + (rs // WIDTH) * stride_wt + slot, mask=rs < TOTAL_W, other=0)
                r_ok = (rs < TOTAL_W) & (rs % WIDTH < w)
                safe_rs = tl.where(r_ok, rs, 0)
                acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, SHRINK_K):
                    ks = k0 + tl.arange(0, SHRINK_K)
                    k_ok = ks < k_hi
                    x = tl.load(x_ptr + safe_rows[:, None] * stride_x + ks[None, :], mask=mine[:, None] & k_ok[None, :],
                                other=0.0)  # fmt: skip
                    a = tl.load(a_ptr + slot * stride_al + safe_rs[None, :] * stride_ar + ks[:, None],
                                mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
                    acc += tl.dot(x, a)
                tl.atomic_add(s_now + rows[:, None] * TOTAL_W + rs[None, :], acc, mask=mine[:, None] & r_ok[None, :],
                              sem="relaxed")  # fmt: skip
        _arrive(state_ptr, programs)
        return

    # ---- a column block: X·Wᵀ, then (once every shrink program has arrived) + S·B[slot]ᵀ (+ bias)
    if PHASE == 2:
        epoch = ((tl.atomic_add(state_ptr, 0) >> 16) - 1) & 0xFFFF  # the PHASE 1 launch has moved it
    else:
        epoch = _arrive(state_ptr, programs)
        if PHASE == 1:
            return
    s_now = s_buffers + (epoch & 1) * BLOCK_M * TOTAL_W
    n0 = pid * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    safe_cols = tl.where(col_ok, cols, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + safe_rows[:, None] * stride_x + ks[None, :]
        w_ptrs = w_ptr + safe_cols[None, :] * stride_w + ks[:, None]
        if EVEN_K:  # rows past the batch are masked, not read (one token reads one row of X)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None] & (ks < hidden)[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(ks < hidden)[:, None], other=0.0)
        acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_cols).to(tl.float32)[None, :]

    if PHASE == 0:
        while ((tl.atomic_add(state_ptr, 0, sem="acquire") >> 16) & 0xFFFF) == epoch:
            pass
    ws = tl.arange(0, BLOCK_W)
    for slot in range(0, n_slots):
        mine = row_slots == slot
        if tl.sum(mine.to(tl.int32), 0) > 0:
            for j in tl.static_range(NUM_SLICES):
                lo = tl.load(bounds_ptr + j)
                hi = tl.load(bounds_ptr + j + 1)
                w_j = tl.load(widths_ptr + j * stride_wt + slot)
                if (n0 < hi) & (n0 + BLOCK_N > lo) & (w_j > 0):
                    s = tl.load(s_now + rows[:, None] * TOTAL_W + j * WIDTH + ws[None, :],
                                mask=mine[:, None] & (ws < w_j)[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
                    in_slice = col_ok & (cols >= lo) & (cols < hi)
                    b = tl.load(b_ptr + slot * stride_bl + safe_cols[None, :] * stride_bn + ws[:, None],
                                mask=in_slice[None, :] & (ws < w_j)[:, None], other=0.0)  # fmt: skip
                    acc += tl.dot(s.to(b.dtype), b)
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def decode_lora_linear(
    out, x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots, state, bias=None,
    plan: DecodePlan | None = None, phases: int = 1,
):  # fmt: skip
    """out (tokens <= 16, out_features) = X·Wᵀ (+ bias) + each token's LoRA delta, every slice of a packed
    layer (lora_a (slots, slices·width, in), lora_b (slots, out_features, width), slot_widths (slices,
    slots), token_slots (>= tokens,) slot or -1), rounded once. `state`: the layer's `new_decode_state`.
    phases=2 runs the shrink as a launch of its own (no in-kernel barrier: what the interpreter can run)."""
    tokens, hidden = x.shape
    if tokens > _TILE_M:
        raise ValueError(f"decode_lora_linear takes at most {_TILE_M} tokens, got {tokens}")
    for t in (x, weight, lora_a, lora_b, out):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_lora_linear needs unit stride in the last dimension, got {tuple(t.shape)}")
    slices, total_width = slot_widths.shape[0], lora_a.shape[1]
    if state.numel() != _STATE_HEADER + 2 * _TILE_M * total_width:
        raise ValueError("decode state was made for another LoRA width: new_decode_state(total width)")
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 1 << 20
    plan = plan or decode_plan(weight.shape[0], hidden, total_width, lora_a.shape[0], sms)
    if plan is None:
        raise ValueError(f"a layer of {weight.shape[0]} outputs needs more programs than the GPU's {sms} SMs")
    width = lora_b.shape[2]
    common = (
        x, weight, out, lora_a, lora_b, token_slots, slot_widths, slice_bounds,
        bias if bias is not None else slice_bounds, state, tokens, lora_a.shape[0], hidden, weight.shape[0],
        plan.tiles, plan.k_per_chunk,
        x.stride(0), weight.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0),
        lora_b.stride(1), slot_widths.stride(0),
    )  # fmt: skip
    constants = dict(
        NUM_SLICES=slices, TOTAL_W=total_width, WIDTH=width, BLOCK_W=max(16, triton.next_power_of_2(width)),
        BLOCK_R=max(16, triton.next_power_of_2(total_width)), HAS_BIAS=bias is not None,
        EVEN_K=hidden % plan.block_k == 0, BLOCK_M=_TILE_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        SHRINK_K=plan.shrink_k, num_warps=4, num_stages=plan.num_stages,
    )  # fmt: skip
    grid = (plan.programs,)
    if phases == 2:
        _decode_lora_linear_kernel[grid](*common, PHASE=1, **constants)
        _decode_lora_linear_kernel[grid](*common, PHASE=2, **constants)
    else:
        _decode_lora_linear_kernel[grid](*common, PHASE=0, **constants)
    return out

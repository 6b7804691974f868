"""One-launch LoRA linear for decode-sized batches: base GEMV, LoRA shrink and expand in a single kernel.

At decode sizes each kernel of the three-kernel path (cuBLAS GEMM, routed shrink, fused expand) costs a few µs of
mostly fixed latency, so the LoRA work, a few hundred kB of A and B, costs as much as the base GEMM itself. This
kernel pays one launch, with two kinds of programs running side by side:

* shrink programs (a few SMs) compute S = X·A[slot]ᵀ for every adapter of the batch, its tokens' rows: the
  pairs (adapter, hidden step) are shared evenly among them in runs, each run one pipelined loop of tl.dot
  per adapter it meets, added into a float32 S buffer with atomics (where S is wider than a program computes
  at once, each group of programs takes one chunk of its columns). However many adapters a batch mixes, a
  program's work is its share of theirs, not a turn per adapter;
* GEMV programs (the other SMs) stream W and accumulate X·Wᵀ, the part that bounds the layer, while the
  shrink runs; then they wait at a grid-wide barrier for every shrink program, add S·B[slot]ᵀ (+ bias) and
  write the output once. Either each owns one block of output columns over the whole hidden dimension
  (its sum stays in registers), or ("stream-K") each takes an equal run of (column block, hidden step)
  pairs, adds its partial sums into a float32 buffer with atomics before arriving, and after the barrier
  the owner of each column block reads its sum back, finishes it and zeroes it for the next launch.
  Stream-K serves the layers whole blocks serve badly: those that would need 16-column blocks to fill the
  SMs, and those too wide for any grid of whole blocks.

Which of these a layer launches, with which blocks, stages and program counts, is a `plans.DecodePlan` read from
the GPU's plan table (plans.py). The barrier needs every program resident at once, so no plan has more programs
than the GPU has SMs. Its state lives in one int32 tensor per layer (`new_decode_state`): one word holding the
epoch (high 16 bits) and the arrivals (low 16 bits), one holding the rows of the last launch, two S buffers, and
the stream-K partial sums. Every program arrives once (whole-block GEMV programs at their start, reading the count
only after their loads; stream-K and shrink programs after their atomics); the waiters go as soon as the count
reaches the grid size, and the last arrival then resets the count and moves the epoch. S buffers alternate by
epoch parity, and each launch zeroes, in the buffer the next launch adds into, the rows the previous launch used
there, so no launch needs a zero-fill kernel of its own and nothing depends on the host: CUDA graphs replay it as
is. Launches of one layer never overlap (one stream), which the parity relies on.

Batches run in tiles of 16, 32 or 64 token rows (`plans.ROW_TILES`): decode steps of up to 64 requests are one
kernel per layer.

Triton's interpreter runs programs one after another, so a spinning program would wait forever: there (and
in `phases=2`, for tests) the shrink and the rest run as two launches, the launch boundary being the barrier.
`lora_linear_slices_reference` in reference.py holds the contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels.compile_ahead import launch
from vllm_bdlora.kernels.launch_math import next_power_of_2
from vllm_bdlora.kernels.plans import (
    DECODE_MAX_TOKENS,
    DEFAULT_MAX_MIXED_WIDTH,
    INTERPRETER_TABLE,
    DecodePlan,
    batch_plan,
    cuda_table,
    state_words,
)

# decode_lora_linear's `skip` (the benchmark's breakdown) as the kernel's SKIP
_SKIPS = {None: 0, "shrink": 1, "finish": 2}


def new_decode_state(total_width: int, device, plan: DecodePlan | None = None) -> torch.Tensor:
    """Barrier words, S buffers and (for a stream-K `plan`) partial sums for one plan: int32, all zero (the
    float32 buffers as their bits). A layer, whose plan changes with the tile, sizes its state for every plan it
    may launch (`plans.layer_state_words`)."""
    return torch.zeros(state_words(total_width, plan), dtype=torch.int32, device=device)


@triton.jit
def _settle(state_ptr, old, programs):
    """After this program's arrival (the word's value before it, `old`): the last one resets the count and
    moves the epoch. Returns the epoch this launch runs in (16 bits)."""
    if (old & 0xFFFF) == programs - 1:
        tl.atomic_add(state_ptr, 65536 - programs)
    return (old >> 16) & 0xFFFF


@triton.jit
def _arrive(state_ptr, programs):
    """Arrive after this program's atomics: one thread issues the arrival (a scalar atomic), so the CTA
    barrier first orders every warp's atomics before it; its acq_rel then publishes them to the waiters."""
    tl.debug_barrier()
    return _settle(state_ptr, tl.atomic_add(state_ptr, 1), programs)


@triton.jit
def _wait(state_ptr, epoch, programs):
    """Spin until every program has arrived: the count reaches the grid size (the waiters need not wait for
    the last arrival's second atomic) or, once it has been reset, the epoch has moved."""
    word = tl.atomic_add(state_ptr, 0, sem="acquire")
    while (((word >> 16) & 0xFFFF) == epoch) & ((word & 0xFFFF) != programs):
        word = tl.atomic_add(state_ptr, 0, sem="acquire")
    tl.debug_barrier()  # the acquire was one thread's: every warp reads S and the partial sums after it


@triton.jit
def _gemv(x_ptr, w_ptr, stride_x, stride_w, safe_rows, row_ok, safe_cols, k_lo, k_hi, hidden,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """X[rows, k_lo:k_hi]·W[cols, k_lo:k_hi]ᵀ in float32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
    return acc


@triton.jit
def _rows_delta(
    s_ptr, b_ptr, widths_ptr, bounds_ptr, row_slot, adapted, rows, cols, n0, stride_split, stride_s, stride_bl,
    stride_bn, stride_w, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_M, BLOCK_N) delta S_j[row, :w]·B[slot of the row, cols, :w]ᵀ over the slices j that the column
    block meets, each row reading its own adapter's B (w: that adapter's width in slice j). Rows that are not
    adapted load nothing: S and B are masked (not multiplied by zero), so no value of another row's adapter, or
    an unwritten S, reaches them. S is read past L1 (.cg): other SMs' atomics wrote it in this launch."""
    slot = tl.where(adapted, row_slot, 0).to(tl.int64)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(NUM_SLICES):
        lo = tl.load(bounds_ptr + j)
        hi = tl.load(bounds_ptr + j + 1)
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            w = tl.load(widths_ptr + j * stride_w + slot, mask=adapted, other=0)
            in_slice = (cols >= lo) & (cols < hi)
            for k0 in range(0, tl.max(w, 0), BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                s_ok = ks[None, :] < w[:, None]
                s_offs = rows[:, None] * stride_s + j * WIDTH + ks[None, :]
                s = tl.load(s_ptr + s_offs, mask=s_ok, other=0.0, cache_modifier=".cg")
                for part in tl.static_range(1, SPLIT_K):
                    s += tl.load(s_ptr + part * stride_split + s_offs, mask=s_ok, other=0.0, cache_modifier=".cg")
                b_ptrs = b_ptr + slot[:, None, None] * stride_bl + cols[None, :, None] * stride_bn + ks[None, None, :]
                b = tl.load(b_ptrs, mask=s_ok[:, None, :] & in_slice[None, :, None], other=0.0)
                delta += tl.sum(s[:, None, :] * b.to(tl.float32), axis=2)
    return delta


@triton.jit
def _finish(acc, n0, out_ptr, b_ptr, bias_ptr, widths_ptr, bounds_ptr, s_now, rows, row_ok, row_slots, n_slots,
            n_cols, stride_out, stride_bl, stride_bn, stride_wt,
            NUM_SLICES: tl.constexpr, TOTAL_W: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ADD_LORA: tl.constexpr,
            ROW_GATHER: tl.constexpr, GATHER_K: tl.constexpr):  # fmt: skip
    """Column block n0's X·Wᵀ sum + bias + S·B[slot]ᵀ of each token's slot (unless not ADD_LORA), written once.
    ROW_GATHER: each row reads its own adapter's B (_rows_delta, GATHER_K ranks a step), so the
    adapters of a batch are served side by side; else one tl.dot per adapter of the batch, in turn."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    safe_cols = tl.where(col_ok, cols, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_cols).to(tl.float32)[None, :]
    if ROW_GATHER:
        if ADD_LORA:
            # a stale slot number past the buffers (CUDA-graph padding rows) is no adapter: nothing is read for it
            adapted = row_ok & (row_slots >= 0) & (row_slots < n_slots)
            acc += _rows_delta(s_now, b_ptr, widths_ptr, bounds_ptr, row_slots, adapted, rows, cols, n0, 0, TOTAL_W,
                               stride_bl, stride_bn, stride_wt, NUM_SLICES, 1, WIDTH, BLOCK_M, BLOCK_N,
                               GATHER_K)  # fmt: skip
    else:
        ws = tl.arange(0, BLOCK_W)
        for slot in range(0, n_slots if ADD_LORA else 0):
            mine = row_slots == slot
            if tl.sum(mine.to(tl.int32), 0) > 0:
                for j in tl.static_range(NUM_SLICES):
                    lo = tl.load(bounds_ptr + j)
                    hi = tl.load(bounds_ptr + j + 1)
                    w_j = tl.load(widths_ptr + j * stride_wt + slot)
                    if (n0 < hi) & (n0 + BLOCK_N > lo) & (w_j > 0):
                        s = tl.load(s_now + rows[:, None] * TOTAL_W + j * WIDTH + ws[None, :],
                                    mask=mine[:, None] & (ws < w_j)[None, :], other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
                        in_slice = col_ok & (cols >= lo) & (cols < hi)
                        b = tl.load(b_ptr + slot * stride_bl + safe_cols[None, :] * stride_bn + ws[:, None],
                                    mask=in_slice[None, :] & (ws < w_j)[:, None], other=0.0)  # fmt: skip
                        # Rows of other slots load S as 0, but 0 times a non-finite B entry is NaN: select, do not rely
                        # on the zeros, so that no adapter's values reach another adapter's (or the base model's) rows.
                        acc += tl.where(mine[:, None], tl.dot(s.to(b.dtype), b), 0.0)
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def _decode_lora_linear_kernel(
    x_ptr, w_ptr, out_ptr, a_ptr, b_ptr, slots_ptr, widths_ptr, bounds_ptr, bias_ptr, state_ptr,
    n_rows, n_slots, hidden, n_cols, tiles, gemv_programs, steps_per_program, stride_x, stride_w,
    stride_out, stride_al, stride_ar, stride_bl, stride_bn, stride_wt,
    PHASE: tl.constexpr, STREAM_K: tl.constexpr, NUM_SLICES: tl.constexpr, TOTAL_W: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHRINK_K: tl.constexpr, S_ROWS: tl.constexpr,
    R_CHUNK: tl.constexpr, SHRINK_GROUPS: tl.constexpr, SKIP: tl.constexpr, SPREAD_SHRINK: tl.constexpr,
    ROW_GATHER: tl.constexpr, GATHER_K: tl.constexpr,
):  # fmt: skip
    """Programs below `gemv_programs` run the GEMV and then finish column blocks; the rest compute S. PHASE 0:
    one launch with the in-kernel barrier. PHASE 1: the shrink, stream-K partial sums and every arrival;
    PHASE 2: the rest, after a PHASE 1 launch (the launch boundary stands in for the barrier)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if SPREAD_SHRINK:  # the shrink's programs fall evenly among the GEMV's: below, pid is the program's role
        shrinks = programs - gemv_programs
        shrinks_before = pid * shrinks // programs
        is_shrink = (pid + 1) * shrinks // programs > shrinks_before
        pid = tl.where(is_shrink, gemv_programs + shrinks_before, pid - shrinks_before)
    s_buffers = (state_ptr + 2).to(tl.pointer_type(tl.float32))  # after the barrier word and the rows word
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    safe_rows = tl.where(row_ok, rows, 0)
    row_slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)

    if pid >= gemv_programs:  # ---- shrink: S[m, :] += X[m, :]·A[slot_m]ᵀ, as a run of (adapter, hidden step) pairs
        if PHASE == 2:
            return
        epoch = (tl.atomic_add(state_ptr, 0) >> 16) & 0xFFFF  # cannot move before this program arrives
        s_now = s_buffers + (epoch & 1) * S_ROWS * TOTAL_W
        rs = tl.arange(0, BLOCK_R)
        # The batch's distinct adapters, numbered in order of their first row: a row leads where no earlier row has
        # its slot (a stale slot number past the buffers, CUDA-graph padding, is no adapter: nothing is read for it)
        adapted = row_ok & (row_slots >= 0) & (row_slots < n_slots)
        earlier = rows[None, :] < rows[:, None]
        same = (row_slots[:, None] == row_slots[None, :]) & adapted[None, :] & earlier
        leads = adapted & (tl.sum(same.to(tl.int32), 1) == 0)
        lead_rank = tl.sum((earlier & leads[None, :]).to(tl.int32), 1)
        distinct = tl.sum(leads.to(tl.int32), 0)
        # Each group of programs (every SHRINK_GROUPS-th chunk of R_CHUNK columns of S) shares the pairs (distinct
        # adapter, hidden step) evenly, in runs: a program's run covers one adapter or crosses into the next, so a
        # batch's adapters add no turns to any one program (each run is one pipelined loop and one atomic add per
        # adapter it meets), and each element of S is added to by the programs of one group only
        chunk, shrink_steps = pid - gemv_programs, tl.cdiv(hidden, SHRINK_K)
        shares = (programs - gemv_programs) // SHRINK_GROUPS
        group, share = chunk % SHRINK_GROUPS, chunk // SHRINK_GROUPS
        pairs = distinct * shrink_steps
        if SKIP == 1:
            pairs = pairs * 0
        for r0 in range(group * R_CHUNK, TOTAL_W, SHRINK_GROUPS * R_CHUNK):
            rc = r0 + tl.arange(0, R_CHUNK)
            step = share * pairs // shares
            end = (share + 1) * pairs // shares
            while step < end:
                nth = step // shrink_steps
                first = step - nth * shrink_steps
                last = tl.minimum(shrink_steps, first + end - step)
                slot = tl.sum(tl.where(leads & (lead_rank == nth), row_slots, 0), 0)
                mine = row_slots == slot
                w = tl.load(widths_ptr + (rc // WIDTH) * stride_wt + slot, mask=rc < TOTAL_W, other=0)
                r_ok = (rc < TOTAL_W) & (rc % WIDTH < w)
                safe_rc = tl.where(r_ok, rc, 0)
                acc = tl.zeros((BLOCK_M, R_CHUNK), dtype=tl.float32)
                for k0 in range(first * SHRINK_K, tl.minimum(last * SHRINK_K, hidden), SHRINK_K):
                    ks = k0 + tl.arange(0, SHRINK_K)
                    k_ok = ks < hidden
                    x = tl.load(x_ptr + safe_rows[:, None] * stride_x + ks[None, :],
                                mask=mine[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                    a = tl.load(a_ptr + slot * stride_al + safe_rc[None, :] * stride_ar + ks[:, None],
                                mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
                    acc += tl.dot(x, a)
                tl.atomic_add(s_now + rows[:, None] * TOTAL_W + rc[None, :], acc,
                              mask=mine[:, None] & r_ok[None, :], sem="relaxed")  # fmt: skip
                step += last - first
        _arrive(state_ptr, programs)
        if pid == gemv_programs:
            # The next launch adds into the other buffer, which the previous launch added into (in the rows it
            # had, recorded in the rows word; tiles change from step to step) and read before it ended. No
            # program of this launch touches it: zeroed after arriving, off the barrier's path.
            s_next = s_buffers + ((epoch + 1) & 1) * S_ROWS * TOTAL_W
            used = tl.load(state_ptr + 1)
            for r0 in range(0, used, 16):
                zero_rows = r0 + tl.arange(0, 16)
                tl.store(s_next + zero_rows[:, None] * TOTAL_W + rs[None, :], tl.zeros((16, BLOCK_R), dtype=tl.float32),
                         mask=(zero_rows < used)[:, None] & (rs < TOTAL_W)[None, :])  # fmt: skip
            tl.store(state_ptr + 1, n_rows)
        return

    if PHASE == 2:
        epoch = ((tl.atomic_add(state_ptr, 0) >> 16) - 1) & 0xFFFF  # the PHASE 1 launch has moved it
    if STREAM_K:  # ---- an even run of (column block, hidden step) pairs, partial sums added into `partials`
        partials = s_buffers + 2 * S_ROWS * TOTAL_W
        partial_stride = tiles * BLOCK_N
        if PHASE != 2:
            k_steps = tl.cdiv(hidden, BLOCK_K)
            step = pid * steps_per_program
            end = tl.minimum(step + steps_per_program, tiles * k_steps)
            while step < end:
                tile = step // k_steps
                first = step - tile * k_steps
                last = tl.minimum(k_steps, first + end - step)
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = cols < n_cols
                acc = _gemv(x_ptr, w_ptr, stride_x, stride_w, safe_rows, row_ok, tl.where(col_ok, cols, 0),
                            first * BLOCK_K, last * BLOCK_K, hidden, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
                tl.atomic_add(partials + rows[:, None] * partial_stride + cols[None, :], acc,
                              mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")  # fmt: skip
                step += last - first
            epoch = _arrive(state_ptr, programs)
            if PHASE == 1:
                return
        if PHASE == 0:
            _wait(state_ptr, epoch, programs)
        s_now = s_buffers + (epoch & 1) * S_ROWS * TOTAL_W
        for tile in range(pid, tiles, gemv_programs):  # the column blocks this program owns
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            sum_ptrs = partials + rows[:, None] * partial_stride + cols[None, :]
            sum_mask = row_ok[:, None] & (cols < n_cols)[None, :]
            acc = tl.load(sum_ptrs, mask=sum_mask, other=0.0, cache_modifier=".cg")
            _finish(acc, tile * BLOCK_N, out_ptr, b_ptr, bias_ptr, widths_ptr, bounds_ptr, s_now, rows, row_ok,
                    row_slots, n_slots, n_cols, stride_out, stride_bl, stride_bn, stride_wt, NUM_SLICES, TOTAL_W,
                    WIDTH, BLOCK_W, HAS_BIAS, BLOCK_M, BLOCK_N, SKIP != 2, ROW_GATHER, GATHER_K)  # fmt: skip
            # Zeroed for the next launch only after the output is written: Triton may re-issue the load above
            # where its value is used (rather than convert its register layout), and a re-issued load after
            # this store read zeros (rows of every other column wrong with a bias, Triton 3.6 on an H200)
            tl.store(sum_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=sum_mask)
    else:  # ---- one whole column block, its sum in registers
        if PHASE == 1:
            _arrive(state_ptr, programs)
            return
        if PHASE == 0:
            old = tl.atomic_add(state_ptr, 1)  # arrive now; the count is looked at after the loads below
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _gemv(x_ptr, w_ptr, stride_x, stride_w, safe_rows, row_ok, tl.where(cols < n_cols, cols, 0), 0, hidden,
                    hidden, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
        if PHASE == 0:
            epoch = _settle(state_ptr, old, programs)
            _wait(state_ptr, epoch, programs)
        s_now = s_buffers + (epoch & 1) * S_ROWS * TOTAL_W
        _finish(acc, pid * BLOCK_N, out_ptr, b_ptr, bias_ptr, widths_ptr, bounds_ptr, s_now, rows, row_ok, row_slots,
                n_slots, n_cols, stride_out, stride_bl, stride_bn, stride_wt, NUM_SLICES, TOTAL_W, WIDTH, BLOCK_W,
                HAS_BIAS, BLOCK_M, BLOCK_N, SKIP != 2, ROW_GATHER, GATHER_K)  # fmt: skip


# A batch that may mix adapters finishes its column blocks with each row gathering its own adapter's B
# (DecodePlan.row_gather): its adapters then cost no turns after the barrier, where every turn is on the critical
# path. The gather's step holds block_m x block_n x GATHER_K products: at most this many, so that it stays in
# registers (four times as many spilled: per decoder layer up to 1.5x the time on an H100).
GATHER_VALUES = 4096


def gather_step(block_m: int, block_n: int, width: int) -> int:
    """The gather's rank step: as many of the adapter's `width` columns as GATHER_VALUES products allow (at least 1)."""
    return max(1, min(next_power_of_2(width), GATHER_VALUES // (block_m * block_n)))


def decode_lora_linear(
    out, x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots, state, bias=None,
    plan: DecodePlan | None = None, phases: int = 1, skip: str | None = None,
):  # fmt: skip
    """out (tokens <= DECODE_MAX_TOKENS, out_features) = X·Wᵀ (+ bias) + each token's LoRA delta, every slice of a
    packed layer (lora_a (slots, slices·width, in), lora_b (slots, out_features, width), slot_widths (slices,
    slots), token_slots (>= tokens,) slot or -1), rounded once. `state`: the layer's `layer_decode_state`, or a
    `new_decode_state` for this plan (by default the plan table's for the layer, batch and GPU). phases=2 runs the
    shrink as a launch of its own (no in-kernel barrier: what the interpreter can run). skip ("shrink" or "finish"; the
    benchmark's breakdown only, the output is then wrong) leaves out the shrink's work or the finish's LoRA term."""
    tokens, hidden = x.shape
    if tokens > DECODE_MAX_TOKENS:
        raise ValueError(f"decode_lora_linear takes at most {DECODE_MAX_TOKENS} tokens, got {tokens}")
    for t in (x, weight, lora_a, lora_b, out):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_lora_linear needs unit stride in the last dimension, got {tuple(t.shape)}")
    slices, total_width = slot_widths.shape[0], lora_a.shape[1]
    table = cuda_table(x.device) or INTERPRETER_TABLE
    sms = table.sms
    if plan is None:  # the layer op passes the plan it chose for the batch
        plan = batch_plan(table, weight.shape[0], hidden, total_width, lora_a.shape[0], tokens, slices,
                          DEFAULT_MAX_MIXED_WIDTH)  # fmt: skip
    if plan is None:
        raise ValueError(f"no one-launch plan for a layer of {weight.shape[0]} outputs, {tokens} tokens, {sms} SMs")
    if tokens > plan.block_m:
        raise ValueError(f"{tokens} tokens do not fit the plan's tile of {plan.block_m} rows")
    if plan.programs > sms:
        raise ValueError(f"{plan} launches more programs than the GPU's {sms} SMs: the barrier could wait forever")
    if state.numel() < state_words(total_width, plan):
        raise ValueError("decode state was made for another LoRA width or plan: new_decode_state(width, device, plan)")
    width = lora_b.shape[2]
    common = (
        x, weight, out, lora_a, lora_b, token_slots, slot_widths, slice_bounds,
        bias if bias is not None else slice_bounds, state, tokens, lora_a.shape[0], hidden, weight.shape[0],
        plan.tiles, plan.gemv_programs, plan.steps_per_program,
        x.stride(0), weight.stride(0), out.stride(0), lora_a.stride(0), lora_a.stride(1), lora_b.stride(0),
        lora_b.stride(1), slot_widths.stride(0),
    )  # fmt: skip
    block_r = max(16, next_power_of_2(total_width))
    constants = dict(
        STREAM_K=plan.stream_k, NUM_SLICES=slices, TOTAL_W=total_width, WIDTH=width,
        BLOCK_W=max(16, next_power_of_2(width)), BLOCK_R=block_r, R_CHUNK=min(plan.shrink_columns, block_r),
        SHRINK_GROUPS=plan.shrink_groups, HAS_BIAS=bias is not None, EVEN_K=hidden % plan.block_k == 0,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SHRINK_K=plan.shrink_k,
        S_ROWS=DECODE_MAX_TOKENS, SKIP=_SKIPS[skip], SPREAD_SHRINK=plan.spread_shrink,
        ROW_GATHER=plan.row_gather, GATHER_K=gather_step(plan.block_m, plan.block_n, width),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    grid = (plan.programs,)
    if phases == 2:
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=1, **constants)
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=2, **constants)
    else:
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=0, **constants)
    return out

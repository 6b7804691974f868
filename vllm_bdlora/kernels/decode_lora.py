"""One-launch LoRA linear for decode-sized batches: base GEMV, LoRA shrink and expand in a single kernel.

At decode sizes each kernel of the layer op (cuBLAS GEMM, routed shrink, fused expand) costs 3-7 µs of
mostly fixed latency, so the LoRA work, a few hundred kB of A and B, costs as much as the base GEMM itself
(archived H200 runs: +5.4-7.5 µs per adapted layer at 1 token). This kernel pays one launch,
with two kinds of programs running side by side:

* shrink programs (a few SMs) each compute S = X·A[slot]ᵀ over a slice of the hidden dimension, for every
  adapter of the batch (one tl.dot per adapter present, its tokens' rows), and add it into a float32 S
  buffer with atomics (where S is wider than a program computes at once, each group of programs takes one
  chunk of its columns: qkv_proj at TP=1 in 64-row tiles, 34.5 -> 26.3 µs, archived H200 runs);
* GEMV programs (the other SMs) stream W and accumulate X·Wᵀ, the part that bounds the layer, while the
  shrink runs; then they wait at a grid-wide barrier for every shrink program, add S·B[slot]ᵀ (+ bias) and
  write the output once. Either each owns one block of output columns over the whole hidden dimension
  (its sum stays in registers), or ("stream-K") each takes an equal run of (column block, hidden step)
  pairs, adds its partial sums into a float32 buffer with atomics before arriving, and after the barrier
  the owner of each column block reads its sum back, finishes it and zeroes it for the next launch.
  Stream-K serves the layers whole blocks serve badly: those that would need 16-column blocks to fill the
  SMs (qkv_proj at TP=4), and those too wide for any grid of whole blocks (gate_up_proj at TP=1, which
  used to fall back to three kernels); `decode_plan` has the rule and the measurements behind it.

The barrier needs every program resident at once, so the grid never has more programs than the GPU has SMs
(`decode_plan` plans none larger, and returns None on a GPU too small to leave the GEMV an SM; the layer op
then keeps its three-kernel path). Its state lives in one
int32 tensor per layer (`new_decode_state`): one word holding the epoch (high 16 bits) and the arrivals
(low 16 bits), one holding the rows of the last launch, two S buffers, and the stream-K partial sums. Every
program arrives once (whole-block GEMV programs at their start, reading the count only after their loads;
stream-K and shrink programs after their atomics); the waiters go as soon as the count reaches the grid size,
and the last arrival then resets the count and moves the epoch. S buffers alternate by epoch parity, and each
launch zeroes, in the buffer the next launch adds into, the rows the previous launch used there, so no launch
needs a zero-fill kernel of its own and nothing depends on the host: CUDA graphs replay it as is. Launches of
one layer never overlap (one stream), which the parity relies on.

Batches run in tiles of 16, 32 or 64 token rows (`ROW_TILES`; the batch's tile, and in layers with several LoRA
slots the adapters it may mix, pick the plan: `batch_plan`): decode steps of up to 64 requests are one kernel per
layer. Tiles over 16 rows take stream-K only in narrow layers (its partial sums for 64 rows of a wide layer would
take megabytes).

Triton's interpreter runs programs one after another, so a spinning program would wait forever: there (and
in `phases=2`, for tests) the shrink and the rest run as two launches, the launch boundary being the barrier.
`lora_linear_slices_reference` in reference.py holds the contract. Measured on an H200 (Llama-3.1-8B shapes, BD
r'=128, archived H200 runs): an adapted decoder layer's four projections take 1.09-1.12× the base
GEMMs' time at TP=4 and 1-4 tokens (three kernels: 1.63×), 1.12-1.14× at TP=2, 1.20-1.23× at TP=1. Batches
mixing 4 adapters over 4 tokens or more gain little or lose (qkv_proj at TP=4: 1.1× the three kernels' time):
the shrink programs run the batch's adapters one after another.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from vllm_bdlora.kernels.compile_ahead import launch
from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2

# The kernel keeps every token's rows in one tile of 16 (the smallest tl.dot), 32 or 64 rows; larger batches
# (prefill, mixed steps) use the layer op's three-kernel path, whose launches amortise over the tokens.
ROW_TILES = (16, 32, 64)
DECODE_MAX_TOKENS = ROW_TILES[-1]
# Layers too wide for whole column blocks take stream-K in 16-row tiles only: at 64 rows its partial sums would
# take 7 MB per gate_up_proj at TP=1 (narrow layers' stream-K plans in larger tiles keep a few hundred kB).
_STREAM_K_ROWS = 16
# ... and with at most this much LoRA width in all (its slices together): wider, the finish's B loads after the
# barrier outweigh the launches saved (`decode_plan` has the measurements).
_STREAM_K_MAX_WIDTH = 256
# Whole-block programs with at least this many hidden steps (in 16-row tiles, and in larger ones, whose stages hold
# fewer) pipeline 6 stages deep where those fit in this much shared memory (a stage of whole_block_step is 18-32 kB;
# H100s and H200s have 227 kB).
_DEEP_PIPELINE_STEPS_16, _DEEP_PIPELINE_STEPS, _DEEP_PIPELINE_BYTES = 24, 48, 150 * 1024
_SHRINK_PROGRAMS_PER_ADAPTER, _MAX_SHRINK_PROGRAMS = 4, 32
# Narrow layers with a hidden dimension this long take stream-K in 128-deep steps over 64-column blocks in 16-row
# tiles, not 256-deep over 32 (Llama-3.1-70B's qkv_proj at TP=8; `decode_plan` has the measurements).
_LONG_HIDDEN = 8192
# The three plan tweaks below were timed at BD r'=128 only, i.e. a LoRA of 16-192 columns per GPU (all slices): each
# applies up to this width, and wider LoRA keeps the plan it had before them, rather than an untimed one.
_TUNED_MAX_WIDTH = 128
# Narrow layers' stream-K programs (16-row tiles) pipeline 3 stages deep, not 4: each runs a short stretch of the
# hidden dimension (8B qkv_proj at TP=4: ~7 steps), and on an H200 3 stages ran it 0.1-0.6 µs faster, never slower
# (archived H200 runs). Wide layers' longer runs lost with 3 (archived H200 runs).
_NARROW_STREAM_K_STAGES = 3
# One-slot narrow layers of at most this many outputs (8B qkv_proj at TP=8, 768) take their stream-K over 64-column
# blocks in 128-deep steps, not 32 x 256: 7.08 -> 6.60 µs at 1 token, 7.42 -> 6.96 at 16, 8/8 rounds on an H200; with
# 4 slots (32 shrink programs) it lost in every round, 0.2-0.9 µs (archived H200 runs); at TP=4
# (1536 outputs) 64 columns lost too.
_NARROW_WIDE_BLOCK_MAX_OUTPUTS = 1024
# Whole-block plans in 16-row tiles whose programs stream a long hidden loop (the 6-stage ones) beside at least this
# many shrink programs number the programs so that the shrink's fall evenly among the GEMV's (`spread_shrink`), up to
# this much LoRA width in all (BD r'=128's widest: qkv_proj at TP=1, 3 x 128); see `_whole_block_plan`.
_SPREAD_MIN_SHRINK, _SPREAD_MAX_WIDTH = 16, 384
# Two int32 words before the S buffers: the barrier (epoch in the high 16 bits, arrivals in the low 16) and
# the rows the previous launch added into its S buffer (the rows the next launch but one must find zeroed).
_STATE_HEADER = 2


@dataclass(frozen=True)
class DecodePlan:
    block_n: int  # output columns per column block
    block_k: int  # hidden step of the GEMV
    shrink_k: int  # hidden step of the shrink
    tiles: int  # column blocks
    gemv_programs: int  # one per column block, or with stream_k as many as share the steps evenly
    stream_k: bool
    steps_per_program: int  # hidden steps (of block_k) per GEMV program: with stream_k a run across blocks
    chunks: int  # shrink programs: each a group of S's columns over an even share of the hidden dimension
    num_stages: int = 4
    num_warps: int = 4
    block_m: int = 16  # token rows (one of ROW_TILES): the batches of up to this many tokens it serves
    shrink_columns: int = 128  # columns of S a shrink program computes at a time
    shrink_groups: int = 1  # the shrink programs split S's columns (in shrink_columns) this many ways
    spread_shrink: bool = False  # shrink programs numbered evenly among the GEMV's, not after them

    def __post_init__(self):
        if self.chunks % self.shrink_groups:  # the kernel gives each group chunks // shrink_groups programs
            raise ValueError(f"{self.chunks} shrink programs do not split into {self.shrink_groups} column groups")

    @property
    def programs(self) -> int:
        return self.gemv_programs + self.chunks

    @property
    def partial_columns(self) -> int:
        """Columns of the float32 partial sums a stream-K plan keeps in the decode state."""
        return self.tiles * self.block_n if self.stream_k else 0


def make_plan(out_features: int, hidden: int, total_width: int, shrink_programs: int, *, block_n: int,
              block_k: int, stream_k: bool, gemv_programs: int = 0, num_stages: int = 4, num_warps: int = 4,
              block_m: int = 16, shrink_columns: int = 0) -> DecodePlan:  # fmt: skip
    """A launch with these choices (the benchmark's configuration sweep builds its candidates here). Whole
    column blocks take one GEMV program each; stream-K shares tiles × hidden steps evenly over at most
    `gemv_programs`. Shrink programs: at most `shrink_programs`, none without a share of the hidden dimension,
    each computing `shrink_columns` of S at a time (by default `default_shrink_columns`); where S is wider
    than that, the programs split its column chunks between them, each over a longer share of the hidden
    dimension, so fewer programs add into each element of S."""
    if block_m not in ROW_TILES:
        raise ValueError(f"no decode plan for {block_m}-row tiles")
    tiles = cdiv(out_features, block_n)
    k_steps = cdiv(hidden, block_k)
    if stream_k:
        steps = cdiv(tiles * k_steps, gemv_programs)
        gemv_programs = cdiv(tiles * k_steps, steps)  # the same longest run on fewer programs
    else:
        steps, gemv_programs = k_steps, tiles
    shrink_columns = shrink_columns or default_shrink_columns(total_width, block_m)
    shrink_k = _shrink_step(shrink_columns)
    groups = max(1, min(cdiv(total_width, shrink_columns), shrink_programs))
    hidden_shares = max(1, min(shrink_programs // groups, cdiv(hidden, shrink_k)))
    return DecodePlan(block_n, block_k, shrink_k, tiles, gemv_programs, stream_k, steps, groups * hidden_shares,
                      num_stages, num_warps, block_m, shrink_columns, groups)  # fmt: skip


def whole_block_step(block_n: int, block_m: int = 16) -> int:
    """The GEMV's hidden step for whole column blocks of `block_n`: some 24 kB of X and W per pipeline stage
    (16 kB of W for 16-row tiles; fewer hidden steps per stage for 64 rows, or four stages would not fit in
    shared memory)."""
    return max(64, min(512, 1 << (16384 // (block_n + block_m)).bit_length() - 1))


def largest_tile(slots: int) -> int:
    """The most token rows a layer with `slots` LoRA slots runs in one launch: tiles over 16 rows serve
    one-slot layers only (`decode_plan` says why)."""
    return DECODE_MAX_TOKENS if slots <= 1 else ROW_TILES[0]


def row_tile(tokens: int) -> int:
    """The tile of token rows a batch of `tokens` (<= DECODE_MAX_TOKENS) runs in."""
    return next(tile for tile in ROW_TILES if tokens <= tile)


def default_shrink_columns(total_width: int, block_m: int) -> int:
    """Columns of S a shrink program computes at a time: all of them, but at most 8192 accumulators (a
    64-row tile's whole width would spill out of registers)."""
    return min(max(16, next_power_of_2(total_width)), 8192 // block_m)


def _shrink_step(columns: int) -> int:
    return max(16, min(128, 8192 // next_power_of_2(columns)))  # some 16 kB of A per step


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _cuda_sms(device) -> int | None:
    """The SM count of a CUDA device (the plans' one fact about the GPU); None for any other device."""
    device = torch.device(device)
    return _sm_count(device.index or 0) if device.type == "cuda" else None


@functools.cache  # asked on every call of the layer op (`usable_plan`): a lookup after the first
def decode_plan(out_features: int, hidden: int, total_width: int, slots: int, sms: int, block_m: int = 16,
                adapters: int | None = None) -> DecodePlan | None:  # fmt: skip
    """The launch for a layer of this shape with `slots` LoRA slots on a GPU with `sms` SMs, for batches in
    tiles of `block_m` token rows that mix at most `adapters` adapters (by default one per slot), or None where
    even the shrink programs would not leave one SM to the GEMV or no whole column blocks fit a wide layer whose
    tile is over 16 rows or whose LoRA is over 256 wide in all (_STREAM_K_ROWS, _STREAM_K_MAX_WIDTH): the layer
    op then keeps its three-kernel path.

    Shrink programs: 4 per adapter the batch may mix (up to 32), more where a batch of that many adapters would
    read a larger share of the bytes (A against W). `batch_plan` passes the adapters a batch may mix: where it
    has fewer tokens than the layer has slots, or the mixed-adapter limit lets it mix fewer, its GEMV keeps the
    SMs the others' shrink would have taken. A shrink program computes every adapter of the batch over its slice of
    the hidden dimension, so a batch of 4 adapters does 4 times the work of one: with one slot, 4 shrink
    programs kept o_proj and down_proj at TP=4 fast; with 4 slots and 4 adapters in the batch, 4 programs
    left the GEMV waiting (down_proj at TP=1 1.8x slower than the three-kernel path), 16 about broke even
    (archived H200 runs; a byte-share rule alone, 4-5 programs there, lost the same
    way again in archived H200 runs).

    The GEMV takes the other SMs: whole column blocks, the narrowest of 32-128 columns that fit (spreading W over the
    most SMs; their sums stay in registers; for one adapter, 32-column blocks that would leave a quarter of the SMs or
    more split into 64-column ones instead, `_split_block_plan`), else stream-K runs of 256-deep steps over blocks of 64
    columns (32 where too few blocks of 64 go round). On an H200 (archived H200 runs, `--configs`):
    16-column blocks stream W slowly, so qkv_proj at TP=4 (1536 outputs) ran 8.25 µs as stream-K 32-column blocks, 9.32
    as 96 whole 16-column blocks; but wherever whole blocks of 32-128 columns fit, even on 55-78% of the SMs, they
    matched or beat stream-K (qkv_proj at TP=1: 22.7 µs on 96 whole 64-column blocks, 23.1-24.3 as stream-K; o_proj at
    TP=4: 6.6 on 64 whole blocks, 7.5 as stream-K on 128 programs): stream-K's partial sums make an extra round trip
    through L2 after the barrier. gate_up_proj at TP=1 (28672 outputs) fits no whole blocks: stream-K, 71.8 µs against
    the three kernels' 73.9 at BD r'=128 (total LoRA width 256); at r'=512 (1024) every stream-K candidate lost, the
    default 254 µs and the best 151 against the three kernels' 130 (archived H200 runs), so wider layers
    keep those. Its blocks are 128 columns wide, 128-deep steps: each program then finishes 1-2 blocks after the
    barrier, not 3-4 of 64 columns (one B load and dot at a time), 69.5-69.8 µs against 71.2-71.3 at 1 token, 74.4-74.7
    against 76.9 at 16 (two hosts, archived H200 runs).
    Whole-block programs whose hidden loop has at least 24 steps pipeline 6 stages deep (4 otherwise): on an H200 at 1 /
    16 tokens qkv_proj at TP=1 (32 steps) 20.0-20.5 -> 17.7-18.5 / 22.4 -> 22.0, down_proj at TP=1 (56) 35.3 ->
    34.0-34.6 / 36.2-36.8 -> 34.8-35.1, gate_up_proj at TP=2 (64) 36.5 -> 34.8 / 38.3 -> 36.1, down_proj at TP=2 (28)
    -0.4, gate_up_proj at TP=4 (32) -0.5 to -0.6, Llama-3.1-70B's at TP=8 (64) -0.4 to -1.3 and its down_proj (28) -0.5;
    with 4-16 steps (o_proj, down_proj at TP=4 and 8, qkv_proj at TP=2) -0.2 to +0.7 µs.
    Where the hidden dimension is 8192 (Llama-3.1-70B's qkv_proj at TP=8, 1280 outputs), 128-deep steps over 64-column
    blocks ran 9.35 and 9.84 µs at 1 and 16 tokens, 256-deep over 32 columns 11.8 and 12.0
    (archived H200 runs); at 4096 (8B) 64 columns were 0.25-0.4 µs faster at TP=8, but at TP=4 0.9 µs slower
    at 16 tokens and on either side of 32 columns at 1 token so 8B keeps 32 columns.
    These narrow stream-K plans pipeline 3 stages deep: against 4, six runs a side alternated on one H200, 8B qkv_proj
    at TP=4 8.79 -> 8.18 µs at 1 token and 8.61 -> 8.41 at 16 (with 4 slots 9.15 -> 8.68, 15.55 -> 15.27), 70B's at TP=8
    -0.1 to -0.2 µs, 8B's at TP=8 level (archived H200 runs).

    Tiles of 32 and 64 rows take whole blocks of 32-128 columns where they fit, each stage with fewer hidden steps
    (`whole_block_step`), 6 stages deep where a program's hidden loop is long (down_proj at TP=1, 64 rows: 49.8 ->
    42.8 µs; at TP=2 26.1 -> 22.5; gate_up_proj at TP=2 -3 to -5%; archived H200 runs); narrow layers,
    where blocks of 32 would leave half the SMs idle (qkv_proj at TP=4: 48 of them), take stream-K over 64-column
    blocks in 32-row tiles (13.1 -> 9.8-10.1 µs), and in 64-row tiles too unless whole 16-column blocks fill at
    least 90% of the programs stream-K would run: qkv_proj at TP=4 (96 blocks of 16 against 96 programs) ran
    12.1-12.3 µs on whole blocks, 11.8-13.3 as stream-K; at TP=8 whole blocks left SMs idle and lost,
    12.35 -> 10.6 µs as stream-K (8B, 48 blocks), 19.8 -> 14.2 (70B, 80 blocks; archived H200 runs).
    Only layers with one LoRA slot use these tiles. Per decoder layer on an H200 (archived H200 runs)
    one adapter at 32 and 64 tokens took 12-20% less time than the three kernels at TP=2 and 4, but a batch mixing
    4 adapters 2-15% more (the finish runs one B load and dot per adapter of the batch after the barrier), and the
    layer cannot know before the launch how many adapters a batch mixes.

    Narrow layers with several LoRA slots give the shrink the SMs whole 16-column blocks would leave (up to 32) in
    16-row tiles too: with 4 slots, qkv_proj at TP=4 and 8 (8B) and at TP=8 (70B) ran 0.1-2.7 µs faster on 32
    shrink programs than on 5-27 (whatever the adapters mixed, but 70B at 2 and 16 tokens of one adapter, 0.4 µs
    slower); with one slot it helped at TP=4 (-0.5 µs) and lost at TP=8 (+0.3-0.5), so one-slot layers keep 4 per
    adapter (archived H200 runs, narrow-*)."""
    if block_m > largest_tile(slots):
        return None
    adapters = max(1, slots if adapters is None else adapters)
    w_elems, a_elems = out_features * hidden, min(adapters, 4) * total_width * hidden
    by_bytes = math.ceil(sms * a_elems / (a_elems + w_elems))
    shrink = min(_MAX_SHRINK_PROGRAMS, max(_SHRINK_PROGRAMS_PER_ADAPTER * adapters, by_bytes))
    shrink_k = _shrink_step(default_shrink_columns(total_width, block_m))
    shrink = min(shrink, cdiv(hidden, shrink_k))  # none without a share of the hidden
    room = sms - shrink
    if room < 1:
        return None
    blocks_of_16 = cdiv(out_features, 16)
    narrow = blocks_of_16 <= room  # few outputs: 32-column blocks would leave half the SMs idle
    if narrow and block_m > _STREAM_K_ROWS:
        spare = _shrink_beside(shrink, sms, blocks_of_16)
        if block_m == ROW_TILES[-1] and blocks_of_16 * 10 >= 9 * (sms - spare):
            return _whole_block_plan(out_features, hidden, total_width, shrink, sms, 16, block_m, adapters)
        return make_plan(out_features, hidden, total_width, spare, block_n=64, block_k=whole_block_step(64, block_m),
                         stream_k=True, gemv_programs=sms - spare, block_m=block_m)  # fmt: skip
    if not narrow:
        for block_n in (32, 64, 128):
            if cdiv(out_features, block_n) <= room:
                if block_n == 32 and _splits_32_column_blocks(out_features, total_width, sms, block_m, adapters):
                    return _split_block_plan(out_features, hidden, total_width, shrink, sms)
                return _whole_block_plan(out_features, hidden, total_width, shrink, sms, block_n, block_m, adapters)
        if block_m > _STREAM_K_ROWS or total_width > _STREAM_K_MAX_WIDTH:
            return None
    if narrow and slots > 1:  # the SMs whole 16-column blocks would leave go to the shrink, as in larger tiles
        shrink = _shrink_beside(shrink, sms, blocks_of_16)
        room = sms - shrink
    tuned = total_width <= _TUNED_MAX_WIDTH
    if not narrow:  # no whole blocks fit: 128 columns leave each program fewer blocks to finish after the barrier
        block_n, block_k, stages = 128, 128, 4
    else:
        stages = _NARROW_STREAM_K_STAGES if tuned else 4
        if hidden >= _LONG_HIDDEN or (tuned and slots == 1 and out_features <= _NARROW_WIDE_BLOCK_MAX_OUTPUTS):
            block_n, block_k = 64, 128
        else:
            block_n, block_k = (64 if cdiv(out_features, 64) >= room else 32), 256
    return make_plan(out_features, hidden, total_width, shrink, block_n=block_n, block_k=block_k, stream_k=True,
                     gemv_programs=room, num_stages=stages)  # fmt: skip


def _splits_32_column_blocks(out_features: int, total_width: int, sms: int, block_m: int, adapters: int) -> bool:
    """Whether whole 32-column blocks give way to `_split_block_plan`: they would take at most 3/4 of the SMs, in a
    16-row tile sized for one adapter whose LoRA stream-K's finish serves (_STREAM_K_MAX_WIDTH)."""
    return (block_m == 16 and adapters == 1 and 4 * cdiv(out_features, 32) <= 3 * sms
            and total_width <= _STREAM_K_MAX_WIDTH)  # fmt: skip


def _split_block_plan(out_features, hidden, total_width, shrink, sms) -> DecodePlan:
    """Where whole 32-column blocks would leave a quarter of the SMs or more to the shrink (qkv_proj at TP=2: 96
    blocks), the same programs as stream-K over 64-column blocks in 128-deep steps (two programs a block, each
    half the hidden dimension): on an H200, eight runs a side alternated, 11.50 -> 10.29 µs at 1 token and 11.78
    -> 10.52 at 16 (and with 4 slots, one adapter, 12.08 -> 10.73), every round; batches mixing 4 adapters lost
    0.25-0.54 µs, so plans sized for several adapters keep whole blocks
    (archived H200 runs)."""
    spare = _shrink_beside(shrink, sms, cdiv(out_features, 32))
    return make_plan(out_features, hidden, total_width, spare, block_n=64, block_k=128, stream_k=True,
                     gemv_programs=sms - spare)  # fmt: skip


def _shrink_beside(shrink: int, sms: int, gemv_blocks: int) -> int:
    """Shrink programs beside `gemv_blocks` GEMV programs: the SMs those leave, at least `shrink`, at most 32."""
    return min(_MAX_SHRINK_PROGRAMS, max(shrink, sms - gemv_blocks))


def _whole_block_plan(out_features, hidden, total_width, shrink, sms, block_n, block_m, adapters) -> DecodePlan:
    """One GEMV program per column block of `block_n`; the shrink takes the SMs the blocks leave (up to 32). Programs
    whose hidden loop is long pipeline 6 stages deep (`decode_plan` has the measurements); short loops for one narrow
    adapter take 2 warps over 64 columns, 3 stages over 32 (up to _TUNED_MAX_WIDTH).

    Long-loop plans in 16-row tiles with 16 or more shrink programs number those among the GEMV's programs
    (`spread_shrink`), not after them. Only which program id takes which role changes, yet the times moved: where a
    program runs depends on its id (numbered last, the shrink's short-lived programs may share one part of the GPU and
    leave the GEMV's streams the rest: our reading, not measured). Spreading every plan's shrink on three H200s (3, 3
    and 8 alternated rounds a side): faster where long GEMV loops run beside 20-32 shrink programs (qkv_proj at TP=1,
    96+32: 0.1-0.6 µs at 1 token, 1.1-1.3 at 16; gate_up_proj at TP=2, 112+20: 0.5-1.0 and 1.5-2.0), 0-0.4 µs slower
    beside 4 shrink programs (128+4) and in stream-K (qkv_proj at TP=2, up to 1.0), -0.2 to +0.3 with short loops
    (TP=8's gate_up_proj, 4 slots): those keep them last. This rule against the same plans unspread on a fourth H200 (8
    rounds), per decoder layer at 1 / 16 tokens: TP=1 -0.6% / -1.1%, TP=2 -0.3% / -1.7%, Llama-3.1-70B at TP=8 -1.2% /
    -2.0% (its gate_up_proj 0.7 / 1.4 µs); TP=4's gate_up_proj +0.06 to +0.2 µs there, -0.35 to +0.07 on the other three
    (archived H200 runs)."""
    spare = _shrink_beside(shrink, sms, cdiv(out_features, block_n))
    step = whole_block_step(block_n, block_m)
    long_loop = cdiv(hidden, step) >= (_DEEP_PIPELINE_STEPS if block_m > 16 else _DEEP_PIPELINE_STEPS_16)
    stages = 6 if long_loop and 6 * 2 * (block_m + block_n) * step <= _DEEP_PIPELINE_BYTES else 4  # 16-bit X, W
    warps = 4
    # Short hidden loops (the 4-stage programs) in 16-row tiles, for one adapter: 64-column blocks run 2 warps
    # (Llama-3.1-70B's o_proj at TP=8: 7.08 -> 6.50 µs at 1 token, 8/8 rounds), 32-column blocks 3 stages (o_proj,
    # down_proj, and gate_up_proj at TP=8: 0.1-0.35 µs faster in most rounds); qkv_proj at TP=2 (192 wide, its shrink
    # on 32 SMs) lost 0.4 µs at 16 tokens with 3 stages (archived H200 runs).
    if block_m == 16 and stages == 4 and adapters == 1 and total_width <= _TUNED_MAX_WIDTH:
        if block_n == 64:
            warps = 2
        elif block_n == 32:
            stages = 3
    plan = make_plan(out_features, hidden, total_width, spare, block_n=block_n, block_k=step, stream_k=False,
                     block_m=block_m, num_stages=stages, num_warps=warps)  # fmt: skip
    if block_m == 16 and stages == 6 and plan.chunks >= _SPREAD_MIN_SHRINK and total_width <= _SPREAD_MAX_WIDTH:
        plan = replace(plan, spread_shrink=True)
    return plan


def plan_for(out_features: int, hidden: int, total_width: int, slots: int, device, tokens: int = 1,
             slices: int = 1) -> DecodePlan | None:  # fmt: skip
    """`batch_plan` on this device's SM count; None off CUDA."""
    sms = _cuda_sms(device)
    return None if sms is None else batch_plan(out_features, hidden, total_width, slots, sms, tokens, slices)


def batch_plan(out_features: int, hidden: int, total_width: int, slots: int, sms: int, tokens: int,
               slices: int = 1) -> DecodePlan | None:  # fmt: skip
    """The plan for a batch of `tokens` in a layer of `slices` slices: its row tile's, sized for the adapters the
    batch may mix (one per token, at most `batch_adapters`): with several slots a one-token batch, a decode
    step at batch size 1, gets a one-slot layer's shrink programs (narrow layers excepted: with several slots
    their shrink takes the SMs 16-column blocks would leave, `decode_plan`)."""
    adapters = min(tokens, batch_adapters(slots, total_width // slices))
    return decode_plan(out_features, hidden, total_width, slots, sms, row_tile(tokens), adapters)


def layer_plans(out_features: int, hidden: int, total_width: int, slots: int, device,
                slices: int = 1) -> dict[int, DecodePlan]:  # fmt: skip
    """Every plan a layer may launch on this device (`plans_on_sms`; none off CUDA)."""
    sms = _cuda_sms(device)
    return {} if sms is None else plans_on_sms(out_features, hidden, total_width, slots, sms, slices)


def plans_on_sms(out_features: int, hidden: int, total_width: int, slots: int, sms: int,
                 slices: int = 1) -> dict[int, DecodePlan]:  # fmt: skip
    """Every plan a layer may launch on a GPU of `sms` SMs, keyed by the smallest batch that takes it (a tile's
    first batches may mix fewer adapters than its larger ones)."""
    first = {}
    for tokens in range(1, DECODE_MAX_TOKENS + 1):
        plan = batch_plan(out_features, hidden, total_width, slots, sms, tokens, slices)
        if plan is not None:
            first.setdefault(plan, tokens)
    return {tokens: plan for plan, tokens in first.items()}


def state_words(total_width: int, plan: DecodePlan | None) -> int:
    """Header, two S buffers of DECODE_MAX_TOKENS rows (a layer's launches change tiles from step to step),
    stream-K partial sums."""
    partials = plan.block_m * plan.partial_columns if plan else 0
    return _STATE_HEADER + 2 * DECODE_MAX_TOKENS * total_width + partials


def new_decode_state(total_width: int, device, plan: DecodePlan | None = None) -> torch.Tensor:
    """Barrier words, S buffers and (for a stream-K `plan`) partial sums for one plan: int32, all zero (the
    float32 buffers as their bits). A layer, whose plan changes with the tile, takes `layer_decode_state`."""
    return torch.zeros(state_words(total_width, plan), dtype=torch.int32, device=device)


def layer_state_words(out_features: int, hidden: int, total_width: int, slots: int, device, slices: int = 1) -> int:
    """The state_words of a layer's decode state: enough for every plan it may launch on this device (a narrow
    layer's plan may be stream-K, with partial sums, in some tiles and not in others)."""
    plans = layer_plans(out_features, hidden, total_width, slots, device, slices).values()
    return max((state_words(total_width, plan) for plan in plans), default=state_words(total_width, None))


def layer_decode_state(out_features: int, hidden: int, total_width: int, slots: int, device,
                       slices: int = 1) -> torch.Tensor:  # fmt: skip
    """A layer's barrier words, S buffers and partial sums for every plan it may launch on this device: int32,
    zero."""
    words = layer_state_words(out_features, hidden, total_width, slots, device, slices)
    return torch.zeros(words, dtype=torch.int32, device=device)


_max_tokens = DECODE_MAX_TOKENS
# Layers with several LoRA slots: a batch of t tokens may mix min(t, slots) adapters, and the one kernel then runs
# every one's shrink on its few shrink programs and one B load and dot per adapter after the barrier, while the
# three kernels spread the adapters over the whole GPU. Per decoder layer on an H200 (4 slots, 4 adapters mixed,
# archived H200 runs), the one kernel against the three (with the current shrink split):
# BD r'=128 at 4-16 tokens 0.86x as fast at TP=1 (128 columns per slice), 0.97-0.99x at TP=2 (64), 0.99-1.07x at
# TP=4 (32); r'=512 0.62-0.64x at TP=1 (512), 0.50-0.56x at TP=2 (256); at 1-2 tokens 1.02-1.42x, except r'=512
# (0.75-0.96x). So a multi-slot layer's batch takes the kernel only while the adapters it may mix are at most this
# wide together, per slice (the plugin's "one_launch_max_mixed_width"): r'=128 keeps it at TP >= 2 and up to 2
# tokens at TP=1, r'=512 up to 1 token at TP=2. Given up: batches of one adapter at TP=1, r'=128, 4-16 tokens,
# which the one kernel ran in 0.91-0.93x the three kernels' time. Plans are sized for the adapters a batch may mix
# (`batch_plan`), not for every slot's.
DEFAULT_MAX_MIXED_WIDTH = 256
_max_mixed_width = DEFAULT_MAX_MIXED_WIDTH
# decode_lora_linear's `skip` (the benchmark's breakdown) as the kernel's SKIP
_SKIPS = {None: 0, "shrink": 1, "finish": 2}


def set_max_tokens(tokens: int) -> None:
    """Serve batches of up to `tokens` (one of ROW_TILES) with this kernel in this process; larger ones take
    the three-kernel path (the plugin's "one_launch_max_tokens" setting)."""
    global _max_tokens
    if tokens not in ROW_TILES:
        raise ValueError(f"the one-launch kernel's token limit must be one of {list(ROW_TILES)}, got {tokens!r}")
    _max_tokens = tokens


def max_tokens() -> int:
    return _max_tokens


def set_max_mixed_width(width: int) -> None:
    """In this process, a layer with several LoRA slots runs this kernel for a batch only while the adapters the
    batch may mix (one per token, at most one per slot) are at most `width` wide per slice together."""
    global _max_mixed_width
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"the one-launch kernel's mixed-adapter width must be an integer >= 0, got {width!r}")
    _max_mixed_width = width


def max_mixed_width() -> int:
    return _max_mixed_width


def mixed_batch_limit(slots: int, width: int, max_width: int | None = None) -> int:
    """The most tokens a batch may have to run this kernel in a layer of `slots` LoRA slots, `width` columns per
    slice and slot (0: none): all of its tile where even every slot's adapter mixed stays within the mixed width
    (`max_width`, by default this process's), else as many tokens as adapters of that width fit in it."""
    max_width = _max_mixed_width if max_width is None else max_width
    if slots <= 1 or slots * width <= max_width:
        return largest_tile(slots)
    return min(largest_tile(slots), max_width // max(width, 1))


def batch_adapters(slots: int, width: int, max_width: int | None = None) -> int:
    """The most adapters a batch this kernel serves may mix in a layer of `slots` LoRA slots, `width` columns per
    slice and slot: one per token of `mixed_batch_limit`'s, at most one per slot (at least 1: a layer whose limit
    is 0 never launches the kernel, so its plan is never used)."""
    return max(1, min(slots, mixed_batch_limit(slots, width, max_width)))


def usable_plan(tokens: int, out_features: int, hidden: int, total_width: int, slots: int, device: torch.device,
                state: torch.Tensor | None = None, slices: int = 1) -> DecodePlan | None:  # fmt: skip
    """The plan the layer op launches this kernel with for a batch of `tokens` on `device`, or None where it keeps
    the three-kernel path: off CUDA, over the token or mixed-adapter limit, or with a decode `state` too small for
    this GPU's plan (a state made on a GPU with another SM count may be; the layer then keeps the three kernels
    rather than fail). `slices`: the packed layer's, whose LoRA width per slice `mixed_batch_limit` weighs."""
    limit = min(max_tokens(), mixed_batch_limit(slots, total_width // slices))
    if tokens > limit or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    plan = plan_for(out_features, hidden, total_width, slots, device, tokens, slices)
    if plan is None or (state is not None and state.numel() < state_words(total_width, plan)):
        return None
    return plan


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
def _finish(acc, n0, out_ptr, b_ptr, bias_ptr, widths_ptr, bounds_ptr, s_now, rows, row_ok, row_slots, n_slots,
            n_cols, stride_out, stride_bl, stride_bn, stride_wt,
            NUM_SLICES: tl.constexpr, TOTAL_W: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ADD_LORA: tl.constexpr):  # fmt: skip
    """Column block n0's X·Wᵀ sum + bias + S·B[slot]ᵀ of each token's slot (unless not ADD_LORA), written once."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    safe_cols = tl.where(col_ok, cols, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_cols).to(tl.float32)[None, :]
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
                                mask=mine[:, None] & (ws < w_j)[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
                    in_slice = col_ok & (cols >= lo) & (cols < hi)
                    b = tl.load(b_ptr + slot * stride_bl + safe_cols[None, :] * stride_bn + ws[:, None],
                                mask=in_slice[None, :] & (ws < w_j)[:, None], other=0.0)  # fmt: skip
                    acc += tl.dot(s.to(b.dtype), b)
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

    if pid >= gemv_programs:  # ---- shrink: S[m, :] += X[m, k-slice]·A[slot_m, :, k-slice]ᵀ, one adapter at a time
        if PHASE == 2:
            return
        epoch = (tl.atomic_add(state_ptr, 0) >> 16) & 0xFFFF  # cannot move before this program arrives
        s_now = s_buffers + (epoch & 1) * S_ROWS * TOTAL_W
        rs = tl.arange(0, BLOCK_R)
        # this program's column chunks (every SHRINK_GROUPS-th of R_CHUNK columns) over its hidden share: each
        # element of S is added to by the programs of one group only
        chunk, shrink_steps = pid - gemv_programs, tl.cdiv(hidden, SHRINK_K)
        shares = (programs - gemv_programs) // SHRINK_GROUPS
        group, share = chunk % SHRINK_GROUPS, chunk // SHRINK_GROUPS
        k_lo = (share * shrink_steps // shares) * SHRINK_K  # every share >= 1 step: shares <= shrink_steps
        k_hi = tl.minimum(((share + 1) * shrink_steps // shares) * SHRINK_K, hidden)
        for slot in range(0, n_slots if SKIP != 1 else 0):
            mine = row_slots == slot
            if tl.sum(mine.to(tl.int32), 0) > 0:
                for r0 in range(group * R_CHUNK, TOTAL_W, SHRINK_GROUPS * R_CHUNK):
                    rc = r0 + tl.arange(0, R_CHUNK)
                    w = tl.load(widths_ptr + (rc // WIDTH) * stride_wt + slot, mask=rc < TOTAL_W, other=0)
                    r_ok = (rc < TOTAL_W) & (rc % WIDTH < w)
                    safe_rc = tl.where(r_ok, rc, 0)
                    acc = tl.zeros((BLOCK_M, R_CHUNK), dtype=tl.float32)
                    for k0 in range(k_lo, k_hi, SHRINK_K):
                        ks = k0 + tl.arange(0, SHRINK_K)
                        k_ok = ks < k_hi
                        x = tl.load(x_ptr + safe_rows[:, None] * stride_x + ks[None, :],
                                    mask=mine[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
                        a = tl.load(a_ptr + slot * stride_al + safe_rc[None, :] * stride_ar + ks[:, None],
                                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
                        acc += tl.dot(x, a)
                    tl.atomic_add(s_now + rows[:, None] * TOTAL_W + rc[None, :], acc,
                                  mask=mine[:, None] & r_ok[None, :], sem="relaxed")  # fmt: skip
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
                    WIDTH, BLOCK_W, HAS_BIAS, BLOCK_N, SKIP != 2)  # fmt: skip
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
                HAS_BIAS, BLOCK_N, SKIP != 2)  # fmt: skip


def decode_lora_linear(
    out, x, weight, lora_a, lora_b, slot_widths, slice_bounds, token_slots, state, bias=None,
    plan: DecodePlan | None = None, phases: int = 1, skip: str | None = None,
):  # fmt: skip
    """out (tokens <= DECODE_MAX_TOKENS, out_features) = X·Wᵀ (+ bias) + each token's LoRA delta, every slice of a
    packed layer (lora_a (slots, slices·width, in), lora_b (slots, out_features, width), slot_widths (slices,
    slots), token_slots (>= tokens,) slot or -1), rounded once. `state`: the layer's `layer_decode_state`, or a
    `new_decode_state` for this plan (by default `decode_plan` for the layer and GPU). phases=2 runs the shrink as a
    launch of its own (no in-kernel barrier: what the interpreter can run). skip ("shrink" or "finish"; the
    benchmark's breakdown only, the output is then wrong) leaves out the shrink's work or the finish's LoRA term."""
    tokens, hidden = x.shape
    if tokens > DECODE_MAX_TOKENS:
        raise ValueError(f"decode_lora_linear takes at most {DECODE_MAX_TOKENS} tokens, got {tokens}")
    for t in (x, weight, lora_a, lora_b, out):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_lora_linear needs unit stride in the last dimension, got {tuple(t.shape)}")
    slices, total_width = slot_widths.shape[0], lora_a.shape[1]
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 1 << 20
    if plan is None:  # the layer op passes `usable_plan`'s; this is the same one
        plan = batch_plan(weight.shape[0], hidden, total_width, lora_a.shape[0], sms, tokens, slices)
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
        S_ROWS=DECODE_MAX_TOKENS, SKIP=_SKIPS[skip], SPREAD_SHRINK=plan.spread_shrink, num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )  # fmt: skip
    grid = (plan.programs,)
    if phases == 2:
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=1, **constants)
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=2, **constants)
    else:
        launch(_decode_lora_linear_kernel, grid, *common, PHASE=0, **constants)
    return out

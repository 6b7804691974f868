"""Launch plans of the LoRA kernels: the tiles, blocks and grid each launch uses, per layer shape and batch.

Plans are data. Each GPU model has a table, `configs/<device name>.json` (the device name as CUDA reports it,
spaces as underscores, the way vLLM names its fused-MoE configurations), written by the benchmarks' candidate
search on that GPU and loaded once per process:

    python -m bench.kernels.decode_lora --configs --write-table     # decode plans (the one-launch kernel)
    python -m bench.kernels.fused_lora --pairs --write-table        # prefill ranges (routed shrink + expand)
    python -m bench.kernels.mixed_batch_plans --write-table        # their decode brackets, over adapters mixed

A layer shape the table lacks, and every shape on a GPU without a table, takes `default_decode_plan` and
`default_prefill_ranges`: short structural rules that are valid for any shape (logged once per shape, with the
command that tunes it). This module chooses plans only; it imports neither Triton nor a GPU.

Decode plans are keyed by what selects them: the layer's outputs, hidden size and LoRA width (all slices), whether
it has one LoRA slot or several, the batch's row tile (16, 32 or 64 tokens) and how many adapters the batch may mix.
Prefill plans are keyed by layer shape and hold token ranges, each with its shrink and expand configurations.
Measured row limits are keyed by layer shape too: for a layer with several LoRA slots, the most tokens a decode
batch may have to run the one-launch kernel rather than the three kernels, where the benchmark timed both on this GPU
(layers it did not time take the row-width rule of `one_launch_max_mixed_width`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from vllm_bdlora.kernels.launch_math import cdiv, next_power_of_2

logger = logging.getLogger("vllm.bdlora")

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
# The one-launch kernel keeps every token's rows in one tile of 16 (the smallest tl.dot), 32 or 64 rows.
ROW_TILES = (16, 32, 64)
DECODE_MAX_TOKENS = ROW_TILES[-1]
# The default LoRA columns per GPU a multi-slot layer's batch may have over all its token rows on the one-launch
# kernel (BdLoraSettings.one_launch_max_mixed_width says why).
DEFAULT_MAX_MIXED_WIDTH = 128
# The default most adapters a batch the one-launch kernel serves may mix (BdLoraSettings.one_launch_max_adapters):
# as many as a multi-slot layer's row tile holds tokens, so by default only the width limit applies.
DEFAULT_MAX_MIXED_ADAPTERS = 16
# Stream-K's partial sums and its finish's B loads grow with the tile and the LoRA width: beyond these the
# default keeps the three-kernel path for layers no whole column blocks fit.
STREAM_K_MAX_ROWS, STREAM_K_MAX_WIDTH = 16, 256
MAX_SHRINK_PROGRAMS = 32
SHARED_MEMORY_BYTES = 227 * 1024  # per SM on H100 and H200: what one program's pipeline stages must fit


@dataclass(frozen=True)
class DecodePlan:
    """One launch of the one-launch decode kernel (decode_lora.py)."""

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
    # The finish adds each row's LoRA term with the row gathering its own adapter's B (a batch's adapters side by
    # side), not with a tl.dot per adapter in turn. Not a table choice: PlanTable.decode_plan sets it for batches
    # that may mix adapters (measured: results/kernels/decode-row-gather-tp4).
    row_gather: bool = False

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

    def stage_bytes(self) -> int:
        """Shared memory one pipeline stage of a GEMV program takes: 16-bit X rows and W columns of one step."""
        return 2 * (self.block_m + self.block_n) * self.block_k


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of the routed shrink or the fused expand (fused_lora.py)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # Expand only: tiles of block_m consecutive tokens in adapter order, each adding the delta of every adapter its
    # rows hold, rather than one tile per adapter's block_m tokens (fused_lora.py, "mixed tiles").
    mixed_tiles: bool = False


@dataclass(frozen=True)
class PrefillRange:
    """The launches of batches from `from_tokens` tokens up to the next range's start."""

    from_tokens: int
    shrink: LaunchConfig
    expand: LaunchConfig
    delta_first: bool = False  # packed layers over an unquantized base write the delta, cuBLAS adds X·Wᵀ onto it


def make_plan(out_features: int, hidden: int, total_width: int, shrink_programs: int, *, block_n: int,
              block_k: int, stream_k: bool, gemv_programs: int = 0, num_stages: int = 4, num_warps: int = 4,
              block_m: int = 16, shrink_columns: int = 0, spread_shrink: bool = False) -> DecodePlan:  # fmt: skip
    """A launch with these choices (the tables' entries and the candidate search are built here). Whole column
    blocks take one GEMV program each; stream-K shares tiles × hidden steps evenly over at most `gemv_programs`.
    Shrink programs: at most `shrink_programs`, none without a share of the hidden dimension, each computing
    `shrink_columns` of S at a time (by default `default_shrink_columns`); where S is wider than that, the programs
    split its column chunks between them, each over a longer share of the hidden dimension."""
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
    shrink_k = shrink_step(shrink_columns)
    groups = max(1, min(cdiv(total_width, shrink_columns), shrink_programs))
    hidden_shares = max(1, min(shrink_programs // groups, cdiv(hidden, shrink_k)))
    return DecodePlan(block_n, block_k, shrink_k, tiles, gemv_programs, stream_k, steps, groups * hidden_shares,
                      num_stages, num_warps, block_m, shrink_columns, groups, spread_shrink)  # fmt: skip


def whole_block_step(block_n: int, block_m: int = 16) -> int:
    """The GEMV's hidden step for whole column blocks of `block_n`: some 24 kB of X and W per pipeline stage."""
    return max(64, min(512, 1 << (16384 // (block_n + block_m)).bit_length() - 1))


def default_shrink_columns(total_width: int, block_m: int) -> int:
    """Columns of S a shrink program computes at a time: all of them, but at most 8192 accumulators."""
    return min(max(16, next_power_of_2(total_width)), 8192 // block_m)


def shrink_step(columns: int) -> int:
    """The shrink's hidden step for `columns` of S at a time: some 16 kB of A per step."""
    return max(16, min(128, 8192 // next_power_of_2(columns)))


# The largest row tile of layers with several LoRA slots. With each row gathering its adapter's B, tiles of 32 and 64
# rows still lose to the three kernels at every adapter count (0.70-0.93x their speed per decoder layer on an H100:
# the kernel's GEMV alone takes most of their time; bench/results/kernels/multi-slot-tiles-tp4-h100);
# `bench.kernels.decode_lora --multi-slot-tile` times larger ones.
MULTI_SLOT_MAX_TILE = ROW_TILES[0]


def largest_tile(slots: int) -> int:
    """The most token rows a layer with `slots` LoRA slots runs in one launch (MULTI_SLOT_MAX_TILE with several)."""
    return DECODE_MAX_TOKENS if slots <= 1 else MULTI_SLOT_MAX_TILE


def row_tile(tokens: int) -> int:
    """The tile of token rows a batch of `tokens` (<= DECODE_MAX_TOKENS) runs in."""
    return next(tile for tile in ROW_TILES if tokens <= tile)


def mixed_batch_limit(slots: int, width: int, max_width: int) -> int:
    """The most tokens a batch may have to run the one-launch kernel in a layer of `slots` LoRA slots, `width`
    columns per slice and slot: with one slot all of its tile; with several, as many tokens as rows of that width fit
    in `max_width` (after the barrier each row gathers its own adapter's B, so a row costs its width whether or not
    its adapter repeats in the batch)."""
    if slots <= 1:
        return largest_tile(slots)
    return min(largest_tile(slots), max_width // max(width, 1))


def mixed_width_limit(max_width: int, max_adapters: int, width: int, slots: int) -> int:
    """The row width a layer of `width` LoRA columns per slice and `slots` slots runs the one-launch kernel under:
    the configured width, and where a batch could mix more than `max_adapters` adapters (one per token, at most one
    per slot), no more rows than that."""
    return min(max_width, max_adapters * width) if slots > max_adapters else max_width


def measured_mixed_width(measured_rows: int | None, max_width: int | None, max_adapters: int, width: int,
                         slots: int) -> int:  # fmt: skip
    """The row width (`mixed_width_limit`'s) a multi-slot layer of `width` LoRA columns per slice runs the one-launch
    kernel under: with `max_width` None (the setting's default) the rows its GPU's plan table measured for the
    layer (`PlanTable.measured_rows`: the one kernel against the three kernels at each token count), where the table
    has measured it, else DEFAULT_MAX_MIXED_WIDTH; a `max_width` the operator set applies as set."""
    if max_width is None:
        max_width = DEFAULT_MAX_MIXED_WIDTH if measured_rows is None else measured_rows * width
    return mixed_width_limit(max_width, max_adapters, width, slots)


def one_launch_tokens(measured_rows: int | None, max_width: int | None, max_adapters: int, width: int,
                      slots: int) -> int:  # fmt: skip
    """The most tokens a batch of a layer of `slots` slots and `width` LoRA columns per slice may have to run the
    one-launch kernel, under these settings (`measured_mixed_width`'s arguments)."""
    return mixed_batch_limit(slots, width, measured_mixed_width(measured_rows, max_width, max_adapters, width, slots))


def batch_adapters(slots: int, width: int, max_width: int) -> int:
    """The most adapters a batch the one-launch kernel serves may mix: one per token of `mixed_batch_limit`'s, at
    most one per slot (at least 1: a layer whose limit is 0 never launches the kernel)."""
    return max(1, min(slots, mixed_batch_limit(slots, width, max_width)))


def state_words(total_width: int, plan: DecodePlan | None) -> int:
    """int32 words of a decode state: two header words (barrier, last rows), two S buffers of DECODE_MAX_TOKENS
    rows (a layer's launches change tiles from step to step), stream-K partial sums."""
    partials = plan.block_m * plan.partial_columns if plan else 0
    return 2 + 2 * DECODE_MAX_TOKENS * total_width + partials


def default_decode_plan(out_features: int, hidden: int, total_width: int, slots: int, sms: int, block_m: int,
                        adapters: int) -> DecodePlan | None:  # fmt: skip
    """A valid plan for any shape: 4 shrink programs per adapter the batch may mix (up to 32); the GEMV on the
    other SMs as whole column blocks, the narrowest of 32-128 columns that fit, else (16-row tiles, LoRA up to
    STREAM_K_MAX_WIDTH) stream-K over 128-column blocks. None (the three-kernel path) where the tile is too large
    for the slots, the GPU too small or nothing fits."""
    if block_m > largest_tile(slots):
        return None
    shrink_k = shrink_step(default_shrink_columns(total_width, block_m))
    shrink = min(MAX_SHRINK_PROGRAMS, 4 * max(1, adapters), cdiv(hidden, shrink_k))
    room = sms - shrink
    for block_n in (32, 64, 128):
        if 1 <= cdiv(out_features, block_n) <= room:
            return make_plan(out_features, hidden, total_width, shrink, block_n=block_n,
                             block_k=whole_block_step(block_n, block_m), stream_k=False, block_m=block_m)  # fmt: skip
    if room < 1 or block_m > STREAM_K_MAX_ROWS or total_width > STREAM_K_MAX_WIDTH:
        return None
    return make_plan(out_features, hidden, total_width, shrink, block_n=128, block_k=128, stream_k=True,
                     gemv_programs=room)  # fmt: skip


def decode_shrink_parts(hidden: int, width: int) -> int:
    """Parts the decode-sized shrink cuts the hidden dimension into: the power of two nearest
    sqrt(hidden / width), 1 to 16, each part at least 64 features (more parts spread the A reads over more SMs;
    the expand then sums more parts of S per row)."""
    parts = 1
    while parts < 16 and (2 * parts) ** 2 * width < 2 * hidden:
        parts *= 2
    return max(1, min(parts, hidden // 64))


def shrink_hidden_step(hidden: int, parts: int) -> int:
    """The decode-sized shrink's step over the hidden dimension: 128 deep where a part is that long, else 64."""
    return 128 if hidden // parts >= 128 else 64


def per_slice_block(width: int) -> int:
    """The decode-sized shrink's column block that covers one slice's ranks (16 to 64 columns)."""
    return 16 if width <= 16 else 32 if width <= 32 else 64


def all_slices_block(width: int, slices: int) -> int:
    """The shrink's column block that covers every slice's ranks at once (16 to 128 columns; tl.dot needs 16): X read
    once."""
    return min(128, max(16, next_power_of_2(width * slices)))


def default_prefill_ranges(out_features: int, hidden: int, width: int, slices: int) -> tuple[PrefillRange, ...]:
    """Valid launches for any shape: decode-sized batches in 16-row tiles, a column block per slice and the hidden
    dimension split `decode_shrink_parts` ways; larger ones in 64 x 64 expand tiles, the shrink covering every
    slice at once with its hidden dimension split until some 256 programs run at 1024 tokens."""
    parts = decode_shrink_parts(hidden, width)
    per_slice = per_slice_block(width)
    expand_k = 16 if width <= 16 else 32
    whole = all_slices_block(width, slices)
    split = 1 << (max(1, min(8, hidden // 256, 256 // (16 * cdiv(width * slices, whole)))).bit_length() - 1)
    return (
        PrefillRange(1, LaunchConfig(16, per_slice, shrink_hidden_step(hidden, parts), split_k=parts),
                     LaunchConfig(16, 64, expand_k, num_stages=2)),
        PrefillRange(DECODE_MAX_TOKENS + 1, LaunchConfig(64, whole, 128, split_k=split),
                     LaunchConfig(64, 64, expand_k, num_stages=1)),
    )  # fmt: skip


def decode_key(out_features: int, hidden: int, total_width: int, slots: int, block_m: int, adapters: int) -> str:
    kind = 1 if slots <= 1 else "many"
    return (f"out={out_features} hidden={hidden} total_width={total_width} slots={kind} tile={block_m} "
            f"adapters={adapters}")  # fmt: skip


def mixed_rows_key(out_features: int, hidden: int, total_width: int) -> str:
    return f"out={out_features} hidden={hidden} total_width={total_width} slots=many"


def prefill_key(out_features: int, hidden: int, width: int, slices: int) -> str:
    return f"out={out_features} hidden={hidden} width={width} slices={slices}"


_DECODE_DEFAULTS = {f.name: f.default for f in fields(DecodePlan) if f.default is not MISSING}


def _plan_json(plan: DecodePlan | None) -> dict | None:
    """A plan as a table entry: the fields that differ from DecodePlan's defaults."""
    if plan is None:
        return None
    return {k: v for k, v in asdict(plan).items() if k not in _DECODE_DEFAULTS or _DECODE_DEFAULTS[k] != v}


def _config_json(config: LaunchConfig) -> dict:
    """A launch as a table entry: every field but flags left off (a table written before a flag existed reads the
    same, and its entries stay as they were)."""
    return {k: v for k, v in asdict(config).items() if v is not False}


def _range_json(r: PrefillRange) -> dict:
    return {"from_tokens": r.from_tokens, "shrink": _config_json(r.shrink), "expand": _config_json(r.expand),
            "delta_first": r.delta_first}  # fmt: skip


def _range_from_json(entry: dict) -> PrefillRange:
    return PrefillRange(entry["from_tokens"], LaunchConfig(**entry["shrink"]), LaunchConfig(**entry["expand"]),
                        entry.get("delta_first", False))  # fmt: skip


@dataclass(frozen=True, eq=False)  # hashed by identity: its methods' caches key on it
class PlanTable:
    """One GPU model's plans, and the defaults for what it lacks."""

    device: str  # the CUDA device name the table was written on
    sms: int  # that device's SM count: decode plans size their grids to it
    decode: dict  # decode_key -> DecodePlan, or None for "keep the three-kernel path"
    prefill: dict  # prefill_key -> tuple of PrefillRange, by from_tokens
    # mixed_rows_key -> the most tokens a decode batch of a layer with several LoRA slots may have to run the
    # one-launch kernel: measured against the three kernels (bench.kernels.decode_lora --write-table)
    mixed_rows: dict = field(default_factory=dict)
    source: str = "no table"  # where it was read from, for the logs
    # what was logged once: layer shapes whose missing plan was said, measured row limits taken
    defaults_said: set = field(default_factory=set, repr=False)

    @classmethod
    def empty(cls, device: str, sms: int) -> PlanTable:
        return cls(device, sms, {}, {})

    @classmethod
    def from_json(cls, text: str, source: str = "no table") -> PlanTable:
        data = json.loads(text)
        decode = {key: None if entry is None else DecodePlan(**entry) for key, entry in data["decode"].items()}
        prefill = {key: tuple(_range_from_json(e) for e in ranges) for key, ranges in data["prefill"].items()}
        return cls(data["device"], data["sms"], decode, prefill, dict(data.get("mixed_rows", {})), source)

    def to_json(self) -> str:
        """The table as written to configs/: one entry per line, keys sorted, so regenerating it gives a readable
        diff."""
        lines = ["{", f'"device": {json.dumps(self.device)},', f'"sms": {self.sms},', '"decode": {']
        entries = [f"{json.dumps(k)}: {json.dumps(_plan_json(self.decode[k]))}" for k in sorted(self.decode)]
        lines.append(",\n".join(entries))
        lines += ["},", '"prefill": {']
        entries = [f"{json.dumps(k)}: {json.dumps([_range_json(r) for r in self.prefill[k]])}"
                   for k in sorted(self.prefill)]  # fmt: skip
        lines.append(",\n".join(entries))
        lines.append("}")
        if self.mixed_rows:  # a table without measured rows reads and writes as before they existed
            lines[-1] += ","
            lines.append('"mixed_rows": {')
            lines.append(",\n".join(f"{json.dumps(k)}: {self.mixed_rows[k]}" for k in sorted(self.mixed_rows)))
            lines.append("}")
        lines += ["}", ""]
        return "\n".join(line for line in lines if line)

    def measured_rows(self, out_features: int, hidden: int, total_width: int) -> int | None:
        """The tokens up to which a multi-slot layer of this shape runs the one-launch kernel, where this GPU's
        table measured it; None where it did not."""
        key = mixed_rows_key(out_features, hidden, total_width)
        rows = self.mixed_rows.get(key)
        if rows is not None and (key, "rows") not in self.defaults_said:  # what replaced the row-width rule, once
            self.defaults_said.add((key, "rows"))
            logger.info("vllm-bdlora: %s: decode batches of up to %d tokens run the one-launch kernel, as measured "
                        "in %s (%s)", key, rows, self.source, self.device)  # fmt: skip
        return rows

    @functools.lru_cache(maxsize=8192)  # noqa: B019  (tables live as long as the process)
    def decode_plan(self, out_features: int, hidden: int, total_width: int, slots: int, block_m: int,
                    adapters: int) -> DecodePlan | None:  # fmt: skip
        """The table's plan for this key (for more adapters than any entry of the layer holds, the entry of the
        most it holds: the shrink programs stop growing with the adapters), else the default; with `row_gather`
        where the batch may mix adapters (a batch of one adapter finishes with one tl.dot: on one H100 the gather
        took up to 1.8 µs more per decoder layer there, and 8-12% less time mixing 4 adapters)."""
        if block_m > largest_tile(slots):
            return None
        plan = None
        for mixed in range(max(1, adapters), 0, -1):
            key = decode_key(out_features, hidden, total_width, slots, block_m, mixed)
            if key in self.decode:
                plan = self.decode[key]
                break
        else:
            layer = f"out={out_features} hidden={hidden} total_width={total_width}"
            self._say_default(layer, decode_key(out_features, hidden, total_width, slots, block_m, adapters),
                              "decode_lora --configs")  # fmt: skip
            plan = default_decode_plan(out_features, hidden, total_width, slots, self.sms, block_m, adapters)
        return replace(plan, row_gather=gathers_rows(slots, adapters)) if plan is not None else None

    @functools.lru_cache(maxsize=1024)  # noqa: B019
    def prefill_ranges(self, out_features: int, hidden: int, width: int, slices: int) -> tuple[PrefillRange, ...]:
        key = prefill_key(out_features, hidden, width, slices)
        if key in self.prefill:
            return self.prefill[key]
        self._say_default(key, key, "fused_lora --pairs")
        return default_prefill_ranges(out_features, hidden, width, slices)

    def prefill_launch(self, tokens: int, out_features: int, hidden: int, width: int, slices: int) -> PrefillRange:
        """The range a batch of `tokens` falls in."""
        ranges = self.prefill_ranges(out_features, hidden, width, slices)
        return next(r for r in reversed(ranges) if r.from_tokens <= tokens)

    def _say_default(self, layer: str, key: str, search: str) -> None:
        # with no table at all its loading said so once; a table lacking a shape says which, once per layer shape
        # (its other batch tiles and adapter counts miss too)
        if (layer, search) in self.defaults_said:
            return
        self.defaults_said.add((layer, search))
        log = logger.info if self.decode or self.prefill else logger.debug
        log("vllm-bdlora: no launch plan for %s in %s (%s); using the structural default for this layer shape "
            "(not logged again for its other batch tiles and adapter counts). Tune one on this GPU with: "
            "python -m bench.kernels.%s --write-table", key, self.source, self.device, search)  # fmt: skip


def table_path(device_name: str) -> str:
    return os.path.join(CONFIG_DIR, device_name.replace(" ", "_") + ".json")


@functools.cache
def table_for(device_name: str, sms: int) -> PlanTable:
    """The table of this GPU model, read once per process; an empty one (defaults everywhere) where there is none,
    or where it was written on a device with another SM count (a MIG slice, another board of the same name)."""
    path = table_path(device_name)
    if not os.path.exists(path):
        logger.info("vllm-bdlora: no launch-plan table for %s (%s); every layer takes the structural default "
                    "plans", device_name, path)  # fmt: skip
        return PlanTable.empty(device_name, sms)
    with open(path) as f:
        table = PlanTable.from_json(f.read(), source=path)
    if table.sms != sms:
        logger.warning("vllm-bdlora: %s was written on %d SMs, this %s has %d; using the structural default plans",
                       path, table.sms, device_name, sms)  # fmt: skip
        return PlanTable.empty(device_name, sms)
    logger.info("vllm-bdlora: launch plans for %s from %s (%d decode, %d prefill entries)", device_name, path,
                len(table.decode), len(table.prefill))  # fmt: skip
    return table


def cuda_table(device) -> PlanTable | None:
    """The table of a CUDA device; None for any other device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = _device_properties(device.index or 0)
    return table_for(*props)


@functools.cache
def _device_properties(index: int) -> tuple[str, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


# Where no CUDA device runs the kernels (Triton's interpreter runs programs one after another: any grid fits).
INTERPRETER_TABLE = PlanTable.empty("Triton interpreter", 1 << 20)


def launch_for(device, tokens: int, out_features: int, hidden: int, width: int, slices: int) -> PrefillRange:
    """The routed shrink and expand launches of a batch of `tokens` in a layer of this shape on `device`."""
    table = cuda_table(device) or INTERPRETER_TABLE
    return table.prefill_launch(tokens, out_features, hidden, width, slices)


def batch_plan(table: PlanTable, out_features: int, hidden: int, total_width: int, slots: int, tokens: int,
               slices: int, max_mixed_width: int) -> DecodePlan | None:  # fmt: skip
    """The plan for a decode batch of `tokens` in a layer of `slices` slices: its row tile's, sized for the adapters
    the batch may mix (`plan_adapters`)."""
    adapters = plan_adapters(slots, total_width // slices, tokens, max_mixed_width)
    return table.decode_plan(out_features, hidden, total_width, slots, row_tile(tokens), adapters)


def gathers_rows(slots: int, adapters: int) -> bool:
    """Whether a plan sized for `adapters` in a layer of `slots` slots finishes with each row gathering its own
    adapter's B (`DecodePlan.row_gather`): where the batch may mix adapters, whichever it holds."""
    return slots > 1 and adapters > 1


def plan_adapters(slots: int, width: int, tokens: int, max_mixed_width: int) -> int:
    """The adapter count a decode batch's plan is sized for (its table key's `adapters`): as many as the batch may
    mix, one per token, at most `batch_adapters`. A batch's plan is chosen from its size alone (a CUDA graph is
    captured per size), so a batch of 16 tokens holding one adapter runs the plan of one holding twelve."""
    return min(tokens, batch_adapters(slots, width, max_mixed_width))


def layer_plans(table: PlanTable, out_features: int, hidden: int, total_width: int, slots: int, slices: int,
                max_mixed_width: int) -> dict[int, DecodePlan]:  # fmt: skip
    """Every plan a layer may launch, keyed by the smallest batch that takes it."""
    first = {}
    for tokens in range(1, DECODE_MAX_TOKENS + 1):
        plan = batch_plan(table, out_features, hidden, total_width, slots, tokens, slices, max_mixed_width)
        if plan is not None:
            first.setdefault(plan, tokens)
    return {tokens: plan for plan, tokens in first.items()}


def layer_state_words(table: PlanTable, out_features: int, hidden: int, total_width: int, slots: int, slices: int,
                      max_mixed_width: int) -> int:  # fmt: skip
    """A layer's decode state: enough for every plan it may launch."""
    plans = layer_plans(table, out_features, hidden, total_width, slots, slices, max_mixed_width).values()
    return max((state_words(total_width, plan) for plan in plans), default=state_words(total_width, None))


def launch_variants(ranges: tuple[PrefillRange, ...], delta_first_layer: bool):
    """Every (shrink) and (expand, shrink's split_k, overwrite) launch a layer with these ranges can make."""
    shrinks = {r.shrink for r in ranges}
    expands = {(r.expand, r.shrink.split_k, r.delta_first and delta_first_layer) for r in ranges}
    return shrinks, expands


def plan_problems(plan: DecodePlan, out_features: int, hidden: int, total_width: int, sms: int) -> list[str]:
    """What makes `plan` unusable for a layer of this shape on a GPU of `sms` SMs (empty: none): the invariants
    every table entry and default must keep."""
    problems = []
    if plan.programs > sms:
        problems.append(f"{plan.programs} programs, {sms} SMs: the barrier needs every program resident")
    if plan != make_plan(out_features, hidden, total_width, plan.chunks, block_n=plan.block_n, block_k=plan.block_k,
                         stream_k=plan.stream_k, gemv_programs=plan.gemv_programs, num_stages=plan.num_stages,
                         num_warps=plan.num_warps, block_m=plan.block_m, shrink_columns=plan.shrink_columns,
                         spread_shrink=plan.spread_shrink):  # fmt: skip
        problems.append("its derived fields are not make_plan's for this shape")
    if plan.tiles * plan.block_n < out_features or plan.gemv_programs * plan.steps_per_program < (
        plan.tiles if not plan.stream_k else plan.tiles * cdiv(hidden, plan.block_k)
    ):
        problems.append("its GEMV programs do not cover every output column over the hidden dimension")
    if plan.num_stages * plan.stage_bytes() > SHARED_MEMORY_BYTES:
        problems.append(f"{plan.num_stages} stages of {plan.stage_bytes()} B exceed shared memory")
    if any(not math.log2(v).is_integer() for v in (plan.block_n, plan.block_k, plan.shrink_columns)):
        problems.append("block sizes must be powers of two")
    return problems

"""Decode-sized batches through a whole adapted layer: the one-launch kernel (kernels/decode_lora.py)
against the layer op's three-kernel path (cuBLAS GEMM, routed shrink, fused expand) and the base GEMM
alone, at Llama-3.1-8B's (or --model-shape's) per-GPU shapes for TP = 1, 2, 4 (--tp) with BD r'=128 (per-GPU
LoRA width 128 / TP; --bd-rank for another r').

    python -m bench.kernels.decode_lora --out DIR
    python -m bench.kernels.decode_lora --model-shape llama-3.1-70b --tp 8,4 --out DIR   # one GPU, TP=8's layers

Both LoRA paths are the custom op BD layers call (`fused_lora_slices_` over an unquantized base), without
and with the layer's decode state; each is checked against the torch reference first. Times: median of 200
CUDA-event-timed replays of a CUDA graph of 10 calls (serving replays graphs), bf16. GB/s: the bytes each
path must read and write at least (W, X, the output, and A and B of every adapter in the batch) over its
time, against the host's measured copy bandwidth. `over_base`: the path's time over the base GEMM's.

    python -m bench.kernels.decode_lora --configs --tp 4 --tokens 1 --adapters 1 --out DIR [--write-table]

times, instead, every candidate launch plan of each layer (whole column blocks of each width that fits,
stream-K at several block shapes, warps, pipeline depth, the shrink's share of SMs) against the one the GPU's
plan table holds, then the table's plan and the eight fastest others again, three rounds in alternating order
(`harness.confirm`); `--write-table` puts the fastest of those rounds' medians into the table
(vllm_bdlora/kernels/configs/<GPU>.json) where it beats the entry by more than `--min-gain`. Each batch is timed
with the plan that serves it, the plan of the adapters a batch of its size may mix (`plans.plan_adapters`: a
16-token batch of a 12-slot layer runs the 12-adapter plan whether it holds 1 adapter or 12), and a plan is
decided on every batch timed that it serves. The tables' decode plans were written by this search, per GPU model
(most of them before the rounds, on the single timings alone), e.g. for every decode plan the 8B and 70B shapes
launch at TP=1-8 with one LoRA slot:

    python -m bench.kernels.decode_lora --configs --write-table --tp 1,2,4,8 --tokens 1,16,32,64 --adapters 1 \
        --out DIR
    python -m bench.kernels.decode_lora --configs --write-table --model-shape llama-3.1-70b --tp 8,4 ... --out DIR
    python -m bench.kernels.decode_lora --configs --write-table --tokens 2,4,16 --adapters 1,2,4 --slots 4 --out DIR

Without --configs, `--write-table` writes what the timed rows say of layers with several LoRA slots: per
projection, the most tokens a decode batch may have to run the one-launch kernel (where it took no more time than
the three kernels, within --min-gain, at every token count timed up to there, summed over the adapter counts
timed), which the plugin
serves by default in place of the row-width rule (`one_launch_max_mixed_width`):

    python -m bench.kernels.decode_lora --write-table --tp 4 --bd-rank 64 --slots 12 --tokens 1,2,4,8,16 \
        --adapters 1,4,12 --out DIR
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import NamedTuple

import torch

from bench.kernels.fused_lora import (
    adapter_bytes,
    add_layer_grid_arguments,
    column_sums,
    layer_grid,
    layer_op_path,
    make_layer,
    reference,
    run_bd_rank,
)
from bench.kernels.harness import (
    CONFIRM_ROUNDS,
    CONFIRM_TOP,
    add_write_table_arguments,
    confirm,
    finalists,
    finish,
    kernel_bench_cli,
    medians,
    report_start,
    time_cuda,
    update_plan_table,
    write_report,
)
from vllm_bdlora.kernels.plans import (
    DEFAULT_MAX_MIXED_ADAPTERS,
    DEFAULT_MAX_MIXED_WIDTH,
    MAX_SHRINK_PROGRAMS,
    DecodePlan,
    batch_plan,
    default_decode_plan,
    gathers_rows,
    make_plan,
    one_launch_tokens,
    plan_adapters,
    plan_problems,
    row_tile,
    whole_block_step,
)

# --mixed-width's default: no limit, so that "one launch" times the kernel wherever it has a plan
LIFTED_WIDTH = 1 << 30


def shapes_title(rows) -> str:
    """The reports' name of the model shape the rows were timed at, e.g. Llama-3.1-70B (JSON written before
    --model-shape existed has no shape: 8B)."""
    return "Llama-" + rows[0].get("shape", "llama-3.1-8b").removeprefix("llama-").upper()


def describe(plan) -> str:
    """A plan in a few words: GEMV kind, column block × hidden step, GEMV + shrink programs."""
    if plan is None:
        return "none: three kernels"
    kind = "stream-K" if plan.stream_k else "whole blocks"
    text = f"{kind} {plan.block_n}x{plan.block_k}, {plan.gemv_programs}+{plan.chunks} programs"
    if (plan.num_warps, plan.num_stages) != (4, 4):
        text += f", {plan.num_warps} warps {plan.num_stages} stages"
    if plan.block_m != 16:
        text += f", {plan.block_m}-row tile"
    if plan.shrink_groups > 1:
        text += f", S in {plan.shrink_groups} column groups"
    if plan.spread_shrink:
        text += ", shrink spread"
    if plan.row_gather:
        text += ", rows gather B"
    return text


def kernel_call(layer, plan, skip=None):
    """The one-launch kernel called directly under `plan` (with a decode state of its own), not through the
    layer op: a callable returning the output."""
    from vllm_bdlora.kernels.decode_lora import decode_lora_linear, new_decode_state

    out = torch.empty(layer["x"].shape[0], layer["weight"].shape[0], dtype=layer["x"].dtype, device="cuda")
    state = new_decode_state(layer["lora_a"].shape[1], "cuda", plan)
    args = (out, layer["x"], layer["weight"], layer["lora_a"], layer["lora_b"], layer["widths"], layer["bounds"],
            layer["slots"], state)  # fmt: skip
    return lambda: decode_lora_linear(*args, plan=plan, skip=skip)


def breakdown_paths(layer, plan) -> dict:
    """The one-launch kernel leaving out the shrink's work (GEMV, barrier and the finish's LoRA term) or the
    finish's LoRA term (GEMV and shrink side by side, then the barrier): against the whole kernel and the
    no-adapter run, which part sits on its critical path. Their outputs are wrong by design, so unchecked."""
    return {f"one_launch_no_{skip}": kernel_call(layer, plan, skip) for skip in ("shrink", "finish")}


def bench_point(tp, name, k, heights, tokens, adapters, copy_gbs, breakdown=False, bd_rank=128, slots=None,
                mixed_width=DEFAULT_MAX_MIXED_WIDTH):  # fmt: skip
    from vllm_bdlora.kernels.fused_lora import group_tokens
    from vllm_bdlora.kernels.lora_op import layer_decode_state
    from vllm_bdlora.kernels.plans import cuda_table

    width, slots = bd_rank // tp, slots or adapters  # main() has checked that --slots holds every adapter
    layer = make_layer(k, heights, tokens, adapters, width, slots=slots)
    want = reference(layer)
    n = sum(heights)
    no_adapter = {**layer, "slots": torch.full_like(layer["slots"], -1)}
    no_adapter["groups"] = group_tokens(no_adapter["slots"], slots)
    shape = (n, k, len(heights) * width, slots)
    state = layer_decode_state(*shape, "cuda", len(heights), mixed_width)
    one_launch = layer_op_path(layer, state, max_mixed_width=mixed_width)
    paths = {
        "base_gemm": lambda: layer["x"] @ layer["weight"].T,
        "three_kernels": layer_op_path(layer),
        "one_launch": one_launch,
        # the kernel's GEMV and barrier without LoRA work: what its LoRA part costs on top
        "one_launch_no_adapter": layer_op_path(
            no_adapter, layer_decode_state(*shape, "cuda", len(heights), mixed_width), max_mixed_width=mixed_width
        ),
    }  # fmt: skip
    tile_plan, op_picks = served_path(cuda_table("cuda"), *shape, tokens, len(heights), mixed_width)
    if breakdown and tile_plan is not None:
        paths.update(breakdown_paths(layer, tile_plan))
    row = {"tp": tp, "layer": name, "tokens": tokens, "adapters": adapters, "slots": slots, "K": k, "N": n,
           "width": width, "slices": len(heights), "mixed_width": mixed_width, "plan": describe(tile_plan),
           "layer_op_picks": "one launch" if op_picks else "three kernels"}  # fmt: skip
    lora_bytes = adapter_bytes(tokens, adapters, k, heights, width)
    for path, fn in paths.items():
        if path not in ("base_gemm", "one_launch_no_shrink", "one_launch_no_finish"):
            expected = want if path != "one_launch_no_adapter" else layer["x"] @ layer["weight"].T
            for _ in range(3):  # repeated calls: the decode state's buffers alternate between them
                torch.testing.assert_close(fn(), expected, atol=5e-2, rtol=5e-2)
        ms = time_cuda(fn, graph_repeats=10)["median_ms"]
        moved = 2 * (n * k + tokens * k + tokens * n) + (lora_bytes if path in ("three_kernels", "one_launch") else 0)
        row[f"{path}_us"] = round(ms * 1e3, 2)
        row[f"{path}_gbs"] = round(moved / (ms * 1e-3) / 1e9, 1)
        row[f"{path}_of_copy_bw"] = round(row[f"{path}_gbs"] / copy_gbs, 3)
    for path in ("three_kernels", "one_launch", "one_launch_no_adapter"):
        row[f"{path}_over_base"] = round(row[f"{path}_us"] / row["base_gemm_us"], 3)
    row["one_launch_speedup"] = round(row["three_kernels_us"] / row["one_launch_us"], 3)
    print(row, flush=True)
    return row


def served_path(table, n, k, total_width, slots, tokens, slices, mixed_width) -> tuple[DecodePlan | None, bool]:
    """A decode batch's plan under `mixed_width` (main() lifts the mixed-adapter limit, unless --mixed-width, so that
    "one launch" times the kernel wherever it has a plan), and whether the layer op runs the one kernel for it with
    the plugin's defaults (the table's measured row limit, else the width rule)."""
    plan = batch_plan(table, n, k, total_width, slots, tokens, slices, mixed_width)
    served = one_launch_tokens(table.measured_rows(n, k, total_width), None, DEFAULT_MAX_MIXED_ADAPTERS,
                               total_width // slices, slots)  # fmt: skip
    return plan, plan is not None and tokens <= served


def shrink_beside(shrink: int, sms: int, gemv_blocks: int) -> int:
    """Shrink programs beside `gemv_blocks` GEMV programs: the SMs those leave, at least `shrink`, at most 32."""
    return min(MAX_SHRINK_PROGRAMS, max(shrink, sms - gemv_blocks))


def candidate_plans(n, k, total_width, slots, adapters, table, block_m=16):
    """The table's plan (the incumbent) and the alternatives its choice weighs: the structural default, whole column
    blocks of every width that fits (with the incumbent's shrink programs or the SMs they leave), stream-K at several
    block shapes (in larger tiles blocks of 32-128 columns, whose stages hold fewer hidden steps), warps, pipeline
    depth and the shrink's share of SMs around the incumbent, and the incumbent with its shrink programs numbered
    among the GEMV's. The incumbent may be None (three kernels), leaving the others."""
    sms = table.sms
    incumbent = table.decode_plan(n, k, total_width, slots, block_m, adapters)
    default = default_decode_plan(n, k, total_width, slots, sms, block_m, adapters)
    anchor = incumbent or default or default_decode_plan(n, k, total_width, 1, sms, 16, adapters)
    shrink = anchor.chunks if anchor else 4
    room = sms - shrink
    plans = [p for p in (incumbent, default) if p]
    for block_n in (16, 32, 64, 128, 256):
        if -(-n // block_n) <= room:
            step = whole_block_step(block_n, block_m)
            beside = shrink_beside(shrink, sms, -(-n // block_n))  # the shrink on the SMs the blocks leave
            for block_k, shrink_programs in ((step, shrink), (max(64, step // 2), shrink), (step, beside)):
                for stages in (4, 6):
                    plans.append(make_plan(n, k, total_width, shrink_programs, block_n=block_n, block_k=block_k,
                                           stream_k=False, block_m=block_m, num_stages=stages))  # fmt: skip
    if block_m == 16:
        stream_k_blocks = ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128), (64, 256), (128, 128),
                           (128, 256))  # fmt: skip
    else:  # X is read by every program: wider blocks read it fewer times, split over the hidden dimension
        stream_k_blocks = [(bn, bk) for bn in (32, 64, 128) for bk in (whole_block_step(bn, block_m), 64)]
    for block_n, block_k in dict.fromkeys(stream_k_blocks):
        for stages in (3, 4):
            plans.append(make_plan(n, k, total_width, shrink, block_n=block_n, block_k=block_k, stream_k=True,
                                   gemv_programs=room, block_m=block_m, num_stages=stages))  # fmt: skip
    if anchor:
        for warps, stages in ((8, 4), (4, 3), (4, 4), (4, 6), (2, 4), (2, 6)):
            plans.append(replace(anchor, num_warps=warps, num_stages=stages))
        for shrink_programs in (8, 16, 32):  # the same GEMV with another share of SMs left to the shrink
            plans.append(make_plan(n, k, total_width, shrink_programs, block_n=anchor.block_n,
                                   block_k=anchor.block_k, stream_k=anchor.stream_k,
                                   gemv_programs=sms - shrink_programs, block_m=block_m,
                                   num_stages=anchor.num_stages, num_warps=anchor.num_warps))  # fmt: skip
        plans.append(replace(anchor, spread_shrink=not anchor.spread_shrink))
    # a plan of another row tile (the fallback anchor is a 16-row plan) cannot run this tile's batches
    return [p for p in dict.fromkeys(plans) if p.block_m == block_m and not plan_problems(p, n, k, total_width, sms)]


def precompile(layer, plans) -> None:
    """Compile every candidate plan's variants on threads (as a server's warm-up does) before timing any. A layer
    point has some sixty candidates, each a variant of the one-launch kernel of 1-2 s of compile
    (results/kernels/compile-time-cpu), so one after another a search over four layers, four batch tiles and two
    widths would spend most of half an hour compiling. Where a compile fails, the pool stops and the timing loop
    compiles what is missing one plan at a time, reporting the plan that fails."""
    from vllm_bdlora.kernels.compile_ahead import compile_concurrently

    compile_concurrently(lambda: [kernel_call(layer, plan)() for plan in plans])


def configs_point(tp, name, k, heights, tokens, adapters, bd_rank=128, slots=None):
    """Every candidate plan of one layer, each checked against the reference, then timed like the layer op; where
    the table holds no plan for the batch (the layer runs the three kernels), the three kernels too, as the
    incumbent: a plan is written only where it beats them. Plans are those of the table key the batch is served
    from (`plans.plan_adapters`: sized for the adapters a batch of its size may mix), whatever the batch holds, so
    that batches of one size mixing 1 or 12 adapters are timed for the one plan that serves them all."""
    from vllm_bdlora.kernels.plans import cuda_table

    width, slots = bd_rank // tp, slots or adapters
    layer = make_layer(k, heights, tokens, adapters, width, slots=slots)
    want, n, total_width = reference(layer), sum(heights), len(heights) * width
    base_us = time_cuda(lambda: layer["x"] @ layer["weight"].T, graph_repeats=10)["median_ms"] * 1e3
    table = cuda_table("cuda")
    tile, sized, incumbent, default, plans = served_candidates(table, n, k, total_width, slots, tokens, width)
    precompile(layer, plans)
    rows, runs = [], []
    # where the table holds no plan, the layer runs the three kernels: the time a plan must beat to be written
    three_kernels = [None] if incumbent is None else []
    for plan in three_kernels + plans:
        run = kernel_call(layer, plan) if plan is not None else layer_op_path(layer)
        try:
            for _ in range(3):
                torch.testing.assert_close(run(), want, atol=5e-2, rtol=5e-2)
        except Exception as e:  # e.g. out of shared memory on this GPU: not a candidate here
            print(f"{describe(plan)}: not timed: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        runs.append(run)
        us = time_cuda(run, graph_repeats=10)["median_ms"] * 1e3
        rows.append({"tp": tp, "layer": name, "tokens": tokens, "adapters": adapters, "plan_adapters": sized,
                     "slots": slots, "width": width, "slices": len(heights), "N": n, "K": k, "tile": tile,
                     "default": plan == incumbent,
                     "structural_default": plan == default, "plan": describe(plan),
                     "plan_fields": asdict(plan) if plan is not None else None,
                     "us": round(us, 2), "base_gemm_us": round(base_us, 2),
                     "over_base": round(us / base_us, 3)})  # fmt: skip
        print({k: v for k, v in rows[-1].items() if k != "plan_fields"}, flush=True)
    return confirm_rows(rows, lambda i: time_cuda(runs[i], graph_repeats=10)["median_ms"] * 1e3)


class ServedCandidates(NamedTuple):
    """What the search times a decode batch with: its row tile, its plan key's size (`plans.plan_adapters`), the
    table's plan that serves it (None: the three kernels), the structural default and the candidates."""

    tile: int
    plan_adapters: int
    incumbent: DecodePlan | None
    default: DecodePlan | None
    candidates: list[DecodePlan]


def served_candidates(table, n, k, total_width, slots, tokens, width) -> ServedCandidates:
    """A decode batch's incumbent as a server looks it up (`plans.batch_plan`), and the default and candidates of
    the key it is served from, each finishing as the served plan does (`row_gather` where the batch may mix
    adapters, whichever it holds)."""
    tile, sized = row_tile(tokens), plan_adapters(slots, width, tokens, LIFTED_WIDTH)
    incumbent = batch_plan(table, n, k, total_width, slots, tokens, total_width // width, LIFTED_WIDTH)
    finish = {"row_gather": gathers_rows(slots, sized)}  # as the table's lookup finishes the incumbent
    default = default_decode_plan(n, k, total_width, slots, table.sms, tile, sized)
    default = replace(default, **finish) if default else None
    plans = list(dict.fromkeys(replace(p, **finish) for p in candidate_plans(n, k, total_width, slots, sized,
                                                                              table, tile)))  # fmt: skip
    return ServedCandidates(tile, sized, incumbent, default, plans)


def confirm_rows(rows: list[dict], time_us) -> list[dict]:
    """One batch's candidate rows with the table's plan (where it was timed) and the CONFIRM_TOP fastest others
    timed again by `time_us(index of the row)`, in `harness.confirm`'s alternating rounds: each such row gains its
    rounds (`us_rounds`) and their median (`confirmed_us`), the times `write_table` decides on."""
    ranked = sorted(range(len(rows)), key=lambda i: rows[i]["us"])
    current = next((i for i in ranked if rows[i]["default"]), None)
    rounds = confirm(finalists(ranked, current), lambda i, _: time_us(i), ["us"])
    for i, median in medians(rounds).items():
        rows[i] = {**rows[i], "confirmed_us": round(median["us"], 2), "us_rounds": rounds[i]["us"]}
    return rows


def write_table(rows, table, min_gain: float) -> list[str]:
    """Update a plan table from --configs rows: for each key timed, the fastest candidate replaces the table's entry
    where it beats it by more than `min_gain` (a fraction; the incumbent keeps its place within noise). Where the
    table had no entry, the fastest is written, or the structural default where that kept its place. Batches of
    several token counts that share a key (one row tile) share its plan, so a candidate's time is its sum over the
    token counts timed (a candidate not timed at every one is left out); so do batches of one size mixing different
    numbers of adapters, which are served from one key (the rows' `plan_adapters`; rows without it, of searches
    that keyed each batch by the adapters it held, by `adapters`). Where the rows were confirmed (`confirm_rows`),
    only the confirming rounds' medians count, so only the candidates confirmed at every batch compete. Returns a
    line per key saying what happened."""
    from vllm_bdlora.kernels.plans import decode_key

    said = []
    by_key = {}
    for r in rows:
        sized = r.get("plan_adapters", r["adapters"])
        key = decode_key(r["N"], r["K"], r["slices"] * r["width"], r["slots"], r["tile"], sized)
        by_key.setdefault(key, []).append(r)
    for key, timed in by_key.items():
        batches = {(r.get("tokens"), r["adapters"]) for r in timed}
        if any("confirmed_us" in r for r in timed):  # searched with confirming rounds: decide on those alone
            timed = [{**r, "us": r["confirmed_us"]} for r in timed if "confirmed_us" in r]
        by_plan = {}
        for r in timed:
            by_plan.setdefault(repr(sorted((r["plan_fields"] or {}).items())), []).append(r)
        summed = [{**runs[0], "us": round(sum(r["us"] for r in runs), 2)} for runs in by_plan.values()
                  if {(r.get("tokens"), r["adapters"]) for r in runs} == batches]  # fmt: skip
        best = min(summed, key=lambda r: r["us"])
        incumbent = next((r for r in summed if r["default"]), None)
        if incumbent is not None and best["us"] >= incumbent["us"] * (1 - min_gain):
            said.append(f"{key}: kept ({incumbent['us']} µs; best other {best['us']} µs)")
            if key not in table.decode and incumbent["plan_fields"] is not None:
                # The incumbent was the structural default: written, so that an entry for fewer adapters (which
                # a key without one falls back to) does not take its place. (Three kernels have no entry to write.)
                table.decode[key] = DecodePlan(**{**incumbent["plan_fields"], "row_gather": False})
            continue
        table.decode[key] = DecodePlan(**{**best["plan_fields"], "row_gather": False})  # not a table choice
        before = f"{incumbent['us']} µs" if incumbent else "no entry"
        said.append(f"{key}: {best['plan']} ({before} -> {best['us']} µs)")
    return said


def write_row_limits(rows, table, tolerance: float) -> list[str]:
    """Update a plan table's measured row limits from timed rows (not --configs): for each projection of a layer
    with several LoRA slots, the most tokens up to which the one-launch kernel took no more time than the three
    kernels at every token count timed, within `tolerance` (a fraction: a difference that small is noise, and the
    one kernel keeps the batch), its time and theirs each summed over the adapter counts timed at that count (a
    count's batches mix any of them). Token counts between two timed ones take the smaller's verdict, and below the
    first the first's (0: none run the one kernel). Returns a line per projection."""
    from vllm_bdlora.kernels.plans import mixed_rows_key

    said = []
    by_key = {}
    for r in rows:
        if r["slots"] > 1 and not r["plan"].startswith("none"):
            key = mixed_rows_key(r["N"], r["K"], r["width"] * r["slices"])
            by_key.setdefault(key, {}).setdefault(r["tokens"], []).append(r)
    for key, by_tokens in by_key.items():
        limit, verdicts = 0, []
        for tokens in sorted(by_tokens):
            one = sum(r["one_launch_us"] for r in by_tokens[tokens])
            three = sum(r["three_kernels_us"] for r in by_tokens[tokens])
            verdicts.append(f"{tokens}: {three / one:.2f}x")
            if one > three * (1 + tolerance):
                break
            limit = tokens
        before = table.mixed_rows.get(key)
        table.mixed_rows[key] = limit
        said.append(f"{key}: up to {limit} tokens (was {'no entry' if before is None else before}; one kernel's "
                    f"speed-up by tokens {', '.join(verdicts)})")  # fmt: skip
    return said


def configs_report(json_path: str) -> str:
    _, rows, lines = report_start(
        json_path,
        lambda rows: (
            f"One-launch decode kernel: its default plan against the alternatives (whole adapted layer, BD "
            f"r'={run_bd_rank(rows)})"
        ),
    )
    lines += [
        "- µs: median of 200 CUDA-event-timed replays of a CUDA graph of 10 calls, per call; bf16; "
        f"{shapes_title(rows)} per-GPU shapes; ×base = over cuBLAS X·Wᵀ alone. Plans: GEMV kind, column block × "
        "hidden step, GEMV + shrink programs. **Bold**: the fastest; (table): the plan the GPU's plan table "
        "holds for the layer and batch; (structural default): what a layer with no table entry runs; (4 slots, "
        "sized for a): a 4-slot layer's plan where a batch may mix at most a adapters."
        + (
            f" Rounds' median: the table's plan and the {CONFIRM_TOP} fastest others timed again, the median of "
            f"{CONFIRM_ROUNDS} alternated rounds, what --write-table decides on."
            if any("confirmed_us" in r for r in rows)
            else ""
        ),
        "",
    ]
    shapes = dict.fromkeys((r["tp"], r["layer"], r["tokens"], r["adapters"]) for r in rows)
    for tp, layer, tokens, adapters in shapes:
        picked = [r for r in rows if (r["tp"], r["layer"], r["tokens"], r["adapters"]) == (tp, layer, tokens, adapters)]
        best = min(r["us"] for r in picked)
        confirmed = any("confirmed_us" in r for r in picked)
        sized = picked[0].get("plan_adapters", adapters)
        served = f" (served by the plan sized for {sized})" if sized != adapters else ""
        lines += [f"## TP={tp} {layer}, {tokens} token(s), {adapters} adapter(s){served}: base "
                  f"{picked[0]['base_gemm_us']} µs",
                  "", "| plan | µs | ×base |" + (" rounds' median µs |" if confirmed else ""),
                  "|---|---|---|" + ("---|" if confirmed else "")]  # fmt: skip
        for r in sorted(picked, key=lambda r: r["us"]):
            label = r["plan"] + (" (table)" if r["default"] else "") + sized_label(r)
            label += " (structural default)" if r.get("structural_default") else ""
            mark = "**" if r["us"] == best else ""
            again = f" {r.get('confirmed_us', '-')} |" if confirmed else ""  # -: not timed again
            lines.append(f"| {mark}{label}{mark} | {r['us']} | {r['over_base']} |{again}")
        lines.append("")
    return write_report(json_path, "decode_configs", lines)


def sized_label(row) -> str:
    """' (4 slots, sized for 1, 2)' where the plan is a 4-slot layer's for those adapter counts (runs before the
    earliest record none)."""
    sized = row.get("sized_for")
    return f" (4 slots, sized for {', '.join(map(str, sized))})" if sized else ""


def report(json_path: str) -> str:
    _, rows, lines = report_start(
        json_path,
        lambda rows: (
            f"One-launch decode kernel vs the three-kernel layer op (whole adapted layer, BD r'={run_bd_rank(rows)})"
        ),
    )
    lines += [
        "- µs: median of 200 CUDA-event-timed replays of a CUDA graph of 10 calls, per call; bf16; "
        f"{shapes_title(rows)} per-GPU shapes; per-GPU LoRA width {run_bd_rank(rows)} / TP; tokens dealt round robin "
        "over the adapters",
        "- paths: base = cuBLAS X·Wᵀ alone; three kernels = the layer op without decode state (cuBLAS GEMM, "
        "routed shrink, fused expand); one launch = the layer op with it (kernels/decode_lora.py). "
        "one launch, no adapter = the same kernel for tokens without an adapter (its GEMV and barrier alone); "
        "(×base) = time over the base GEMM's; GB/s = bytes moved at least (W, X, out, A and B of each adapter "
        "used) over the time, and its share of the copy bandwidth",
        "",
        "| TP | layer | tokens | adapters | base µs (GB/s) | three kernels µs (×base) | one launch µs (×base, "
        "GB/s, of copy) | speed-up | one launch, no adapter µs (×base) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with_plans = all("plan" in r for r in rows)  # older runs did not record it
    if with_plans:
        lines[-2:] = [lines[-2] + " one-launch plan |", lines[-1] + "---|"]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['layer']} | {r['tokens']} | {adapters_label(r)} | {r['base_gemm_us']} "
            f"({r['base_gemm_gbs']}) | {r['three_kernels_us']} ({r['three_kernels_over_base']}) | "
            f"**{r['one_launch_us']}** ({r['one_launch_over_base']}, {r['one_launch_gbs']}, "
            f"{r['one_launch_of_copy_bw']:.0%}) | {r['one_launch_speedup']}× | {r['one_launch_no_adapter_us']} "
            f"({r['one_launch_no_adapter_over_base']}) |" + (f" {plan_label(r)} |" if with_plans else "")
        )
    broken_down = [r for r in rows if "one_launch_no_shrink_us" in r]
    if broken_down:
        lines += ["", "Where the one-launch kernel's LoRA part goes (`--breakdown`), µs over the no-adapter run: the "
                  "finish's LoRA term (the kernel without the shrink's work) and the shrink past the GEMV (the "
                  "kernel without the finish's LoRA term); the outputs of those two runs are wrong by design.", "",
                  "| TP | layer | tokens | adapters | one launch | no adapter | finish's LoRA term | shrink past the "
                  "GEMV |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in broken_down:
            base = r["one_launch_no_adapter_us"]
            lines.append(f"| {r['tp']} | {r['layer']} | {r['tokens']} | {r['adapters']} | {r['one_launch_us']} | "
                         f"{base} | {r['one_launch_no_shrink_us'] - base:+.2f} | "
                         f"{r['one_launch_no_finish_us'] - base:+.2f} |")  # fmt: skip
    if any(r["adapters"] == 1 and r.get("slots", 1) == 1 for r in rows):
        lines += per_decoder_layer_one_adapter(rows)
    lines += per_decoder_layer_by_slots(rows)
    return write_report(json_path, "decode_lora", lines)


def path_sums(rows) -> tuple[float, float, float]:
    """Base GEMM, three kernels and one launch, µs summed over `rows` (a decoder layer's four projections)."""
    return column_sums(rows, ("base_gemm_us", "three_kernels_us", "one_launch_us"))


def per_decoder_layer_one_adapter(rows) -> list[str]:
    lines = ["", "Per decoder layer (the four kinds summed), 1 adapter:", ""]
    lines += ["| TP | tokens | base µs | three kernels µs (×base) | one launch µs (×base) |", "|---|---|---|---|---|"]
    for tp in dict.fromkeys(r["tp"] for r in rows):
        for tokens in dict.fromkeys(r["tokens"] for r in rows):
            picked = [r for r in rows if (r["tp"], r["tokens"], r["adapters"], r.get("slots", 1)) == (tp, tokens, 1, 1)]
            if not picked:
                continue
            base, three, one = path_sums(picked)
            lines.append(f"| {tp} | {tokens} | {base:.1f} | {three:.1f} ({three / base:.2f}) | {one:.1f} "
                         f"({one / base:.2f}) |")  # fmt: skip
    return lines


def plan_label(row) -> str:
    """The one-launch plan, and where the layer op would not run it by default (rows of current
    runs say so: the mixed-adapter limit)."""
    turned_down = row.get("layer_op_picks") == "three kernels" and not row["plan"].startswith("none")
    return row["plan"] + ("; the layer op picks three kernels" if turned_down else "")


def adapters_label(row) -> str:
    """The batch's adapters, and the layer's LoRA slots where they differ (rows before --slots record none)."""
    slots = row.get("slots", row["adapters"])
    return str(row["adapters"]) if slots == row["adapters"] else f"{row['adapters']} of {slots} slots"


def rule_picks_one(row) -> bool:
    """Whether the layer op runs a row's batch on the one kernel where the GPU's table has no measured row limit for
    its projection (the row-width rule, default settings)."""
    rule = one_launch_tokens(None, None, DEFAULT_MAX_MIXED_ADAPTERS, row["width"], row["slots"])
    return not row["plan"].startswith("none") and row["tokens"] <= rule


def per_decoder_layer_by_slots(rows) -> list[str]:
    """Per decoder layer sums for layers with several LoRA slots, by the adapters a batch mixes: whether the
    one-launch kernel or the three kernels should serve a batch of that many tokens, and (rows that record it,
    from the mixed-adapter limit on) what the layer op runs by default."""
    settings = dict.fromkeys((r["adapters"], r["slots"]) for r in rows if r.get("slots", 1) > 1)
    if not settings:
        return []
    with_choice = all("layer_op_picks" in r for r in rows)
    lines = ["", "Per decoder layer (the four kinds summed), layers with several LoRA slots:", "",
             "| TP | adapters | tokens | base µs | three kernels µs (×base) | one launch µs (×base) | speed-up |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    if with_choice:
        lines[-3] = ("Layer op: what the plugin runs with its defaults (the GPU table's measured row limits where it "
                     "has them); row-width rule: what it runs where the table has none (t × LoRA columns per GPU <= "
                     f"{DEFAULT_MAX_MIXED_WIDTH}).")  # fmt: skip
        lines[-2:] = ["", lines[-2] + " layer op µs (×base) | row-width rule µs (×base) |", lines[-1] + "---|---|"]
    for tp in dict.fromkeys(r["tp"] for r in rows):
        for adapters, slots in settings:
            for tokens in dict.fromkeys(r["tokens"] for r in rows):
                picked = [r for r in rows if (r["tp"], r["tokens"], r["adapters"], r.get("slots")) ==
                          (tp, tokens, adapters, slots)]  # fmt: skip
                if not picked:
                    continue
                base, three, one = path_sums(picked)
                line = (f"| {tp} | {adapters_label(picked[0])} | {tokens} | {base:.1f} | {three:.1f} "
                        f"({three / base:.2f}) | {one:.1f} ({one / base:.2f}) | {three / one:.2f}× |")  # fmt: skip
                if with_choice:
                    op = sum(r["three_kernels_us"] if r["layer_op_picks"] == "three kernels" else r["one_launch_us"]
                             for r in picked)  # fmt: skip
                    rule = sum(r["one_launch_us"] if rule_picks_one(r) else r["three_kernels_us"] for r in picked)
                    line += f" {op:.1f} ({op / base:.2f}) | {rule:.1f} ({rule / base:.2f}) |"
                lines.append(line)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_grid_arguments(p, tp="4,2,1", tokens="1,4,16,32,64")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the kernel without the shrink's work, and without the finish's LoRA term",
    )
    p.add_argument(
        "--slots",
        type=int,
        help="LoRA slots per layer (vLLM's --max-loras), at least --adapters' count; default: the batch's adapters",
    )
    p.add_argument(
        "--mixed-width",
        type=int,
        default=LIFTED_WIDTH,
        help="the one kernel's mixed-adapter width while timing (default: unlimited, so 'one launch' times the "
        "kernel wherever it has a plan, multi-slot plans sized for one adapter per token up to one per slot; "
        f"{DEFAULT_MAX_MIXED_WIDTH}, the plugin's default: plans sized and batches over the limit sent to the three "
        "kernels as served)",
    )
    p.add_argument(
        "--multi-slot-tile",
        type=int,
        choices=(16, 32, 64),
        help="time layers of several LoRA slots in row tiles up to this many tokens (default: "
        "plans.MULTI_SLOT_MAX_TILE, what serving runs); batches past it take the three kernels",
    )
    p.add_argument("--configs", action="store_true",
                   help="instead: time every candidate plan of each layer (decode_configs.json/.csv/.md)")  # fmt: skip
    add_write_table_arguments(
        p,
        "--configs",
        "the fastest candidate of each layer and batch (without --configs: "
        "each multi-slot projection's measured row limit, the most tokens up to which the one "
        "kernel took no more time than the three kernels, within --min-gain)",
    )

    def kind(args):  # --configs times (and reports) candidate plans instead
        # checked here, after parsing and before the GPU is asked for
        if args.slots is not None and args.slots < max(map(int, args.adapters.split(","))):
            p.error(f"--slots {args.slots} is fewer than the {args.adapters} adapters of --adapters: a layer holds one "
                    "adapter per slot; raise --slots to the largest adapter count or leave it out")  # fmt: skip
        if args.write_table is not None and not args.configs and args.mixed_width != LIFTED_WIDTH:
            p.error("--write-table measures the one kernel's row limits where it is timed at every batch: leave out "
                    "--mixed-width")  # fmt: skip
        return (configs_report, "decode_configs") if args.configs else (report, "decode_lora")

    started = kernel_bench_cli(p, argv, report, "decode_lora", kind=kind)
    if started is None:
        return 0
    args, copy_gbs, chosen_report, name = started
    if args.multi_slot_tile:
        from vllm_bdlora.kernels import plans

        plans.MULTI_SLOT_MAX_TILE = args.multi_slot_tile  # this process's plans only: a measurement, not a setting
    rows = []
    for tp, layer_name, k, heights, t, a in layer_grid(args):
        if a > t:  # a batch of t tokens mixes at most t adapters: the point a = t times it
            continue
        if args.configs:
            points = configs_point(tp, layer_name, k, heights, t, a, args.bd_rank, args.slots)
        else:
            points = [bench_point(tp, layer_name, k, heights, t, a, copy_gbs, args.breakdown, args.bd_rank,
                                  args.slots, args.mixed_width)]  # fmt: skip
        rows += [{"shape": args.model_shape, **point} for point in points]
    status = finish(args.out, name, rows, copy_gbs, chosen_report)
    if args.write_table is not None and args.configs:
        update_plan_table(args.write_table, lambda table: write_table(rows, table, args.min_gain))
    elif args.write_table is not None:
        update_plan_table(args.write_table, lambda table: write_row_limits(rows, table, args.min_gain))
    return status


if __name__ == "__main__":
    raise SystemExit(main())

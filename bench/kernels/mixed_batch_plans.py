"""Launches of the routed shrink and fused expand for decode-sized batches, chosen over how many adapters a batch
mixes.

A layer with several LoRA slots (a server's --max-loras) runs batches of more than a few tokens on three kernels:
cuBLAS GEMM, routed shrink, fused expand (or the expand writing the delta first and cuBLAS accumulating onto it).
Its plan table's range for the batch size holds one launch whatever the batch mixes: which adapters a batch holds
is known on the device only, and a CUDA graph replays the launch it captured. So that launch must serve a batch of
one adapter and a batch of a dozen alike. This search times candidate launches at every adapter count of
--adapters, in layers of --slots slots, and keeps per layer and decode bracket (1-16, 17-32, 33-64 tokens) the
launch with the lowest mean time relative to the table's current launch, provided no adapter count is slower than
with the current launch by more than --min-gain.

    python -m bench.kernels.mixed_batch_plans --tp 4 --width 8 --tokens 16,32,64 --adapters 1,4,12 \\
        --out DIR [--write-table] [--layers gate_up_proj,down_proj]

Each layer-and-bracket point is written to the results and the table as it finishes: a search cut short keeps
what it finished, and --layers searches the rest.

The search goes a kernel at a time: shrinks under the table's expand, then expands (in place, and delta first in
packed layers; a tile per adapter's rows, or mixed tiles) after the best shrink, then shrinks again under the best
expand. Each round's variants compile on threads before any is timed, and every candidate is checked against the
torch reference before it is timed. The rounds time each candidate once, so they steer the search; the choice is
made on the current launch and the eight best others timed again, three rounds in alternating order (each one's
median: `harness.confirm`). `mixed_batch_plans.md` gives per layer and per decoder layer the current and the chosen
launch's times in those rounds at each adapter count, and the chosen launches.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, replace

from bench.kernels.fused_lora import (
    checked_ms,
    column_sums,
    fused_paths,
    graph_ms,
    layers,
    make_layer,
    reference,
    table_launch,
)
from bench.kernels.harness import (
    CONFIRM_ROUNDS,
    add_write_table_arguments,
    choose,
    confirm,
    finalists,
    finish,
    kernel_bench_cli,
    medians,
    relative_times,
    report_start,
    update_plan_table,
    write_report,
    write_results,
)
from vllm_bdlora.kernels.plans import (
    DECODE_MAX_TOKENS,
    ROW_TILES,
    LaunchConfig,
    all_slices_block,
    per_slice_block,
)

# The decode brackets a search writes a range for: batches up to 16, 32 and 64 tokens (the one-launch kernel's
# row tiles, which CUDA-graph batch sizes fill).
BRACKET_ENDS = ROW_TILES
# The projections a search may pick (--layers), in the order it searches them
LAYER_NAMES = tuple(name for name, _, _ in layers(1))


@dataclass(frozen=True)
class Candidate:
    shrink: LaunchConfig
    expand: LaunchConfig
    delta_first: bool

    def label(self) -> str:
        s, e = self.shrink, self.expand
        order = "delta first" if self.delta_first else "in place"
        tiles = ", mixed tiles" if e.mixed_tiles else ""
        return (f"shrink {s.block_n} cols x {s.block_k} deep, split {s.split_k}, {s.num_warps} warps; expand "
                f"{e.block_m}x{e.block_n}{tiles}, {e.num_warps} warps; {order}")  # fmt: skip


def bracket(tokens: int) -> tuple[int, int]:
    """The decode bracket [first, last] a batch of `tokens` falls in."""
    last = next(end for end in BRACKET_ENDS if tokens <= end)
    index = BRACKET_ENDS.index(last)
    return (BRACKET_ENDS[index - 1] + 1 if index else 1), last


def shrink_candidates(hidden: int, width: int, slices: int, current: LaunchConfig) -> list[LaunchConfig]:
    """16-row shrinks (decode ranges keep 16-row shrink tiles): one slice's or every slice's columns per program, the
    hidden dimension split 4-32 ways in 64- or 128-deep steps, 1, 2 or 4 warps (a dozen adapters' A is read from
    memory rather than from the cache that serves one adapter's re-reads: more, smaller programs keep more of it in
    flight); the current launch first."""
    found = [current]
    for block_n in dict.fromkeys((per_slice_block(width), all_slices_block(width, slices))):
        for split_k in (4, 8, 16, 32):
            for block_k in (64, 128):
                if hidden // split_k < block_k:
                    continue
                for warps in (1, 2, 4):
                    found.append(LaunchConfig(16, block_n, block_k, split_k=split_k, num_warps=warps, num_stages=3))
    return list(dict.fromkeys(found))


def expand_candidates(tokens: int, current: LaunchConfig) -> list[LaunchConfig]:
    """Expands of 16-row tiles (a dozen adapters leave a group a few rows) or one tile of the whole bracket, 64-256
    columns, 1-8 warps, each with a tile per adapter's rows or with mixed tiles (rows of any adapters); the current
    launch first."""
    rows = dict.fromkeys((16, bracket(tokens)[1]))
    found = [current] + [LaunchConfig(block_m, block_n, current.block_k, num_warps=warps, num_stages=2,
                                      mixed_tiles=mixed)
                         for mixed in (False, True) for block_m in rows for block_n in (64, 128, 256)
                         for warps in (1, 2, 4, 8)]  # fmt: skip
    return list(dict.fromkeys(found))


def candidate_path(layer, candidate: Candidate):
    in_place, delta_first, _ = fused_paths(layer, candidate.shrink, candidate.expand)
    return delta_first if candidate.delta_first else in_place


def precompile(layers_by_adapters: dict, candidates: list[Candidate]) -> None:
    """Compile every candidate's variants on threads (as a server's warm-up does) before timing any."""
    from vllm_bdlora.kernels.compile_ahead import compile_concurrently

    layer = next(iter(layers_by_adapters.values()))
    compile_concurrently(lambda: [candidate_path(layer, c)() for c in candidates])


def time_candidates(layers_by_adapters: dict, wants: dict, candidates: list[Candidate], timed: dict) -> None:
    """Fill `timed` (candidate -> {adapters: ms, or None where it failed}) for the candidates not yet in it."""
    fresh = [c for c in candidates if c not in timed]
    precompile(layers_by_adapters, fresh)
    for c in fresh:
        timed[c] = {adapters: checked_ms(candidate_path(layer, c), wants[adapters], f"{c.label()}, {adapters} adapters")
                    for adapters, layer in layers_by_adapters.items()}  # fmt: skip


def search_point(name, k, heights, tokens, adapter_counts, width, slots, tp, min_gain) -> dict:
    """One layer at one batch size: the coordinate search's rounds, every timed candidate, the choice."""
    layers_by_adapters = {a: make_layer(k, heights, tokens, a, width, slots=slots) for a in adapter_counts}
    wants = {a: reference(layer) for a, layer in layers_by_adapters.items()}
    one = next(iter(layers_by_adapters.values()))
    launch = table_launch(one)
    packed = len(heights) > 1
    current = Candidate(launch.shrink, launch.expand, launch.delta_first and packed)
    shrinks = shrink_candidates(k, width, len(heights), launch.shrink)
    expands = expand_candidates(tokens, launch.expand)
    orders = (False, True) if packed else (False,)
    timed: dict = {}
    time_candidates(layers_by_adapters, wants, [current], timed)
    best = current
    for round_ in ("shrink", "expand", "shrink"):
        if round_ == "shrink":
            trials = [replace(best, shrink=s) for s in shrinks]
        else:
            trials = [replace(best, expand=e, delta_first=d) for e in expands for d in orders]
        time_candidates(layers_by_adapters, wants, trials, timed)
        best = choose(timed, current, min_gain)
    # The rounds steer the search; the choice is made on the current launch and the best others timed again
    timed_again = finalists(ranked(timed, current), current)
    rounds = confirm(timed_again, lambda c, adapters: graph_ms(candidate_path(layers_by_adapters[adapters], c)),
                     list(adapter_counts))  # fmt: skip
    again = medians(rounds)
    chosen = choose(again, current, min_gain)
    row = {"tp": tp, "layer": name, "tokens": tokens, "K": k, "N": sum(heights), "slices": len(heights),
           "width": width, "slots": slots, "adapters": list(adapter_counts),
           "current": _candidate_json(current), "chosen": _candidate_json(chosen),
           "current_ms": _by_adapters(again[current]), "chosen_ms": _by_adapters(again[chosen]),
           "candidates": len(timed), "best": best_candidates(timed, current),
           "confirmed": [{**_candidate_json(c), "ms": _by_adapters(again[c]),
                          "rounds": {str(a): t for a, t in rounds[c].items()}} for c in timed_again]}  # fmt: skip
    print({key: value for key, value in row.items() if key != "best"}, flush=True)
    return row


def ranked(timed: dict, current: Candidate) -> list[Candidate]:
    """The candidates timed at every adapter count, by mean time relative to the current launch, lowest first."""
    relative = relative_times(timed, current)
    return sorted(relative, key=lambda c: statistics.mean(relative[c].values()))


def best_candidates(timed: dict, current: Candidate, keep: int = 5) -> list[dict]:
    """The `keep` candidates of lowest mean time relative to the current launch in the search's rounds, with their
    times: what the results keep of the search (every candidate's count is in the row's `candidates`)."""
    return [{**_candidate_json(c), "ms": _by_adapters(timed[c])} for c in ranked(timed, current)[:keep]]


def _by_adapters(times: dict) -> dict:
    return {str(a): (round(ms, 5) if ms is not None else None) for a, ms in times.items()}


def _candidate_json(c: Candidate) -> dict:
    return {"shrink": asdict(c.shrink), "expand": asdict(c.expand), "delta_first": c.delta_first}


def _candidate_from_json(entry: dict) -> Candidate:
    return Candidate(LaunchConfig(**entry["shrink"]), LaunchConfig(**entry["expand"]), entry["delta_first"])


def write_decode_ranges(rows, table) -> list[str]:
    """Give each searched layer's decode bracket its chosen launch: the bracket becomes a range of its own (split
    from the range that held it, whose launch the batches outside the bracket keep) where the choice differs from
    the current launch. A layer the table lacks starts from the structural default's ranges. Returns a line per
    row."""
    from vllm_bdlora.kernels.plans import PrefillRange, default_prefill_ranges, prefill_key

    said = []
    for r in rows:
        key = prefill_key(r["N"], r["K"], r["width"], r["slices"])
        ranges = list(table.prefill.get(key) or default_prefill_ranges(r["N"], r["K"], r["width"], r["slices"]))
        chosen, current = _candidate_from_json(r["chosen"]), _candidate_from_json(r["current"])
        if chosen == current:
            said.append(f"{key}, {r['tokens']} tokens: kept the current launch")
            table.prefill[key] = tuple(ranges)
            continue
        first, last = bracket(r["tokens"])
        for start in (first, last + 1):  # the bracket's own range; the batches past it keep what they had
            if start not in (rng.from_tokens for rng in ranges):
                holder = max((rng for rng in ranges if rng.from_tokens <= start), key=lambda rng: rng.from_tokens)
                ranges.append(replace(holder, from_tokens=start))
        ranges.sort(key=lambda rng: rng.from_tokens)
        index = next(i for i, rng in enumerate(ranges) if rng.from_tokens == first)
        ranges[index] = PrefillRange(first, chosen.shrink, chosen.expand, chosen.delta_first)
        table.prefill[key] = tuple(ranges)
        gains = ", ".join(f"{a} adapters {r['current_ms'][a]} -> {r['chosen_ms'][a]} ms" for a in r["chosen_ms"])
        said.append(f"{key}, {first}-{last} tokens: {chosen.label()} ({gains})")
    return said


def report(json_path: str) -> str:
    _, rows, lines = report_start(
        json_path, "Routed kernels' launches for decode-sized batches, chosen over the adapters a batch mixes"
    )
    counts = rows[0]["adapters"] if rows else []
    confirmed = bool(rows) and "confirmed" in rows[0]
    rounds_said = f"the median of {CONFIRM_ROUNDS} alternated rounds, each the " if confirmed else ""
    lines += [
        f"- layers of {rows[0]['slots'] if rows else '-'} LoRA slots, per-GPU LoRA width "
        f"{rows[0]['width'] if rows else '-'}, Llama-3.1-8B TP={rows[0]['tp'] if rows else '-'} per-GPU shapes, bf16; "
        "tokens dealt round robin over the batch's adapters",
        f"- ms: {rounds_said}"
        "median of 50 CUDA-event-timed replays of a CUDA graph of 10 calls, per call: the whole layer (cuBLAS "
        "GEMM + routed shrink + fused expand in place, or the expand writing the delta and cuBLAS accumulating onto "
        "it); current = the plan table's launch when the run began, chosen = what the search keeps",
        "",
        "| layer | tokens | " + " | ".join(f"{a} adapter(s): current / chosen ms" for a in counts)
        + " | candidates | chosen launch |",
        "|---|---|" + "---|" * len(counts) + "---|---|",
    ]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r['current_ms'][str(a)]:.4f} / **{r['chosen_ms'][str(a)]:.4f}**" for a in counts)
        same = r["chosen"] == r["current"]
        label = "the current launch" if same else _candidate_from_json(r["chosen"]).label()
        lines.append(f"| {r['layer']} | {r['tokens']} | {cells} | {r['candidates']} | {label} |")
    lines += ["", "## Per decoder layer (the layer kinds summed)", "",
              "µs; × one adapter: the time over the same launch's with one adapter in the batch.", "",
              "| tokens | adapters | current µs (× one adapter) | chosen µs (× one adapter) | chosen / current |",
              "|---|---|---|---|---|"]  # fmt: skip
    for tokens in sorted({r["tokens"] for r in rows}):
        picked = [r for r in rows if r["tokens"] == tokens]
        sums = {a: column_sums([{"c": r["current_ms"][str(a)], "n": r["chosen_ms"][str(a)]} for r in picked],
                               ("c", "n")) for a in counts}  # fmt: skip
        one = sums[counts[0]]
        for a, (cur, new) in sums.items():
            lines.append(f"| {tokens} | {a} | {cur * 1e3:.1f} ({cur / one[0]:.2f}) | **{new * 1e3:.1f}** "
                         f"({new / one[1]:.2f}) | {new / cur:.3f} |")  # fmt: skip
    return write_report(json_path, "mixed_batch_plans", lines)


def comma_ints(text: str) -> list[int]:
    """A comma-separated list of integers (argparse's `type`: a malformed one is a usage error)."""
    return [int(part) for part in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4, help="Llama-3.1-8B per-GPU layer shapes at this TP")
    p.add_argument("--width", type=int, default=8, help="per-GPU LoRA width (BD r' / TP; 8 = r'=32 at TP=4)")
    p.add_argument("--tokens", type=comma_ints, default="16,32,64",
                   help=f"batch sizes, one per decode bracket (up to {DECODE_MAX_TOKENS})")  # fmt: skip
    p.add_argument("--adapters", type=comma_ints, default="1,4,12", help="adapters per batch the launch must serve "
                   "(the first is the per-decoder-layer ratios' reference)")  # fmt: skip
    p.add_argument("--slots", type=int, help="LoRA slots of every layer, a server's --max-loras (default: the most "
                   "adapters of --adapters)")  # fmt: skip
    p.add_argument("--layers", default=",".join(LAYER_NAMES),
                   help="the projections to search, comma-separated (default: all four), e.g. to finish a search "
                   "that a host's time limit cut short")  # fmt: skip
    add_write_table_arguments(p, "the search", "each searched layer's chosen launch for its decode bracket")

    def checked(args):  # before the GPU is asked for, so that a dry run on CPU catches a bad command line
        tokens = args.tokens
        if max(tokens) > DECODE_MAX_TOKENS or len({bracket(t) for t in tokens}) < len(tokens):
            p.error(
                f"--tokens: at most one batch size per decode bracket ({BRACKET_ENDS}), none over {DECODE_MAX_TOKENS}"
            )
        unknown = sorted(set(args.layers.split(",")) - set(LAYER_NAMES))
        if unknown:
            p.error(f"--layers: no projection {', '.join(unknown)}; choose from {', '.join(LAYER_NAMES)}")
        return report, "mixed_batch_plans"

    started = kernel_bench_cli(p, argv, report, "mixed_batch_plans", kind=checked)
    if started is None:
        return 0
    args, copy_gbs, _, _ = started
    counts, tokens = args.adapters, args.tokens
    slots = args.slots or max(counts)
    picked = args.layers.split(",")
    rows = []
    for name, k, heights in layers(args.tp):
        if name not in picked:
            continue
        for t in tokens:
            rows.append(search_point(name, k, heights, t, counts, args.width, slots, args.tp, args.min_gain))
            # Kept point by point: a search cut short (a host's time limit) keeps what it finished, in its results
            # and in the table, and --layers can finish the rest
            write_results(args.out, "mixed_batch_plans", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})
            if args.write_table is not None:
                update_plan_table(args.write_table, lambda table, row=rows[-1]: write_decode_ranges([row], table))
    return finish(args.out, "mixed_batch_plans", rows, copy_gbs, report)


if __name__ == "__main__":
    raise SystemExit(main())

"""Two sides of a decode-kernel change, alternated round by round on one host: per-projection medians and the rounds
each side won, from `gpu_host.sh switch` runs (or any folders of `bench.kernels.decode_lora` results).

Every `decode_lora.json` under RUNS is read; its folder's path names the side and the round as `SIDE-rROUND` (the
rest of the path names the benchmark line): `0-r3/tp4_8/decode_lora.json` is side 0, round 3, line tp4_8;
`8b-new-r1/decode_lora.json` is side new, round 1, line 8b. Rounds pair the sides, so a host that drifts during the
call moves both (the switch runs them in alternating order), and "rounds" counts the pairs where B was faster.

    python -m bench.kernels.switch_table RUNS --sides 0,1 [--out RUNS/switch.md] [--min-gain 0.02]

Where the rows say how the layer op serves each batch (the one kernel up to the table's row limit, the three
kernels past it), the tables add each decoder layer as served, and where they name their layer's LoRA width, each
plan-table change the sides differ by, judged on every timed batch it serves by the search's own rule (more than
--min-gain less time summed): a table key's plan on the batches served from that key (`plans.plan_adapters`), a
row limit on the batches between the two limits. That is how a searched table is checked before it is committed.

    python -m bench.kernels.switch_table RUNS --sides old,new --table vllm_bdlora/kernels/configs/GPU.json \
        [--assemble search-rounds/tables/GPU.json]

adds each decoder layer under TABLE, a table assembled from the changes that held: every timed batch of a projection
must run under it as on one of the sides (the same plan and path, looked up as a server does), whose times it then
takes; a batch that runs as on neither is an error. Unchanged projections take side A's times. With --assemble,
TABLE is the table before (the checkout's, as the old side ran it) and first receives the changes that held, each
as AFTER (the table the new side ran) serves it, and nothing else: entries a search wrote as the plan a batch
already ran would become the fallback of batch sizes nobody timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections import defaultdict
from dataclasses import replace

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_SIDE_ROUND = re.compile(r"(?:^|[-/])(?P<side>[^-/]+)-r(?P<round>\d+)(?=[-/]|$)")


def side_round_line(label: str) -> tuple[str, int, str] | None:
    """(side, round, line) from a run folder's path relative to RUNS, or None where it names no `SIDE-rROUND`."""
    match = _SIDE_ROUND.search(label)
    if match is None:
        return None
    line = (label[: match.start()] + "/" + label[match.end() :]).strip("-/").replace("//", "/")
    return match["side"], int(match["round"]), line or "-"


def read_runs(root: str) -> dict:
    """{(line, shape, tp, layer, tokens, adapters, slots): {side: {round: row}}}"""
    found = defaultdict(lambda: defaultdict(dict))
    for folder, _, files in os.walk(root):
        if "decode_lora.json" not in files:
            continue
        parsed = side_round_line(os.path.relpath(folder, root))
        if parsed is None:
            continue
        side, round_, line = parsed
        with open(os.path.join(folder, "decode_lora.json")) as f:
            results = json.load(f)
        for row in results["rows"] if isinstance(results, dict) else results:
            key = (line, row.get("shape", "llama-3.1-8b"), row["tp"], row["layer"], row["tokens"], row["adapters"],
                   row.get("slots") or row["adapters"])  # fmt: skip
            found[key][side][round_] = row
    return found


def _order(key) -> tuple:
    line, shape, tp, layer, tokens, adapters, slots = key
    return line, shape, tp, slots, adapters, tokens, PROJECTIONS.index(layer) if layer in PROJECTIONS else 9


def tables(found: dict, side_a: str, side_b: str, min_gain: float = 0.02, table_path: str | None = None,
           after_path: str | None = None) -> str:  # fmt: skip
    keys = sorted((k for k in found if found[k].get(side_a) and found[k].get(side_b)), key=_order)
    if not keys:
        raise SystemExit(f"no layer was timed on both sides {side_a!r} and {side_b!r}: check --sides against the "
                         "run folders' SIDE-rROUND names")  # fmt: skip
    point = "| line | shape | TP | slots | adapters | tokens |"
    lines = [f"One-launch µs, median over rounds; rounds: pairs where {side_b} was faster.", "",
             f"{point} layer | {side_a} | {side_b} | {side_b} - {side_a} | rounds | plan (where the sides differ) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    per_layer = defaultdict(lambda: {"a": 0.0, "b": 0.0, "base": [], "rounds": []})
    for key in keys:
        a, b = found[key][side_a], found[key][side_b]
        median_a = statistics.median(row["one_launch_us"] for row in a.values())
        median_b = statistics.median(row["one_launch_us"] for row in b.values())
        deltas = {r: b[r]["one_launch_us"] - a[r]["one_launch_us"] for r in set(a) & set(b)}  # paired rounds
        won = sum(delta < 0 for delta in deltas.values())
        plan_a, plan_b = next(iter(a.values()))["plan"], next(iter(b.values()))["plan"]
        plans = "" if plan_a == plan_b else f"{plan_a} → {plan_b}"
        line, shape, tp, layer, tokens, adapters, slots = key
        lines.append(f"| {line} | {shape} | {tp} | {slots} | {adapters} | {tokens} | {layer} | {median_a:.2f} | "
                     f"{median_b:.2f} | {median_b - median_a:+.2f} | {won}/{len(deltas)} | {plans} |")  # fmt: skip
        total = per_layer[(line, shape, tp, slots, adapters, tokens)]
        total["a"] += median_a
        total["b"] += median_b
        total["base"].append(statistics.median(row["base_gemm_us"] for row in [*a.values(), *b.values()]))
        total["rounds"].append(deltas)
    lines += ["", "Per decoder layer (the projections timed, medians summed; base = cuBLAS GEMMs alone; rounds: those "
              f"whose projections summed were faster on {side_b}):", "",
              f"{point} base µs | {side_a} | {side_b} | rounds |", "|---" * 10 + "|"]  # fmt: skip
    for (line, shape, tp, slots, adapters, tokens), total in per_layer.items():
        base, a, b = sum(total["base"]), total["a"], total["b"]
        common = set.intersection(*(set(deltas) for deltas in total["rounds"]))  # rounds every projection has
        won = sum(sum(deltas[r] for deltas in total["rounds"]) < 0 for r in common)
        lines.append(f"| {line} | {shape} | {tp} | {slots} | {adapters} | {tokens} | {base:.1f} | "
                     f"{a:.2f} ({a / base:.3f}x) | {b:.2f} ({b / base:.3f}x) | {won}/{len(common)} |")  # fmt: skip
    lines += served_tables(found, keys, side_a, side_b)
    verdicts, held = change_verdicts(found, keys, side_a, side_b, min_gain)
    lines += verdicts
    if after_path:
        said = assemble(held, after_path, table_path)
        lines += ["", f"Written into `{os.path.basename(table_path)}` from `{os.path.basename(after_path)}`, the "
                  f"changes that held ({len(said)}):", "", *(f"- {line}" for line in said)]  # fmt: skip
    if table_path:
        lines += table_tables(found, keys, side_a, side_b, table_path)
    return "\n".join(lines) + "\n"


def served_us(row: dict) -> float:
    """A decode_lora row's time as the layer op serves the batch: the one kernel where it picks it (up to the
    table's row limit), else the three kernels."""
    return row["one_launch_us"] if row["layer_op_picks"] == "one launch" else row["three_kernels_us"]


def _recording(found: dict, keys: list, sides: tuple, *fields: str) -> list:
    """The keys whose rows on every side record `fields` (rows of older runs lack some)."""
    return [k for k in keys if all(field in row for side in sides for row in found[k][side].values()
                                   for field in fields)]  # fmt: skip


def _median(rows: dict, time) -> float:
    return statistics.median(time(row) for row in rows.values())


def _rounds_won(found: dict, keys: list, side_a: str, side_b: str, time) -> str:
    """Rounds (those every key has on both sides) in which `time` summed over the keys was less on side B."""
    common = set.intersection(*(set(found[k][side_a]) & set(found[k][side_b]) for k in keys))
    won = sum(sum(time(found[k][side_b][r]) - time(found[k][side_a][r]) for k in keys) < 0 for r in common)
    return f"{won}/{len(common)}"


def _change(a: float, b: float) -> str:
    return f"{a:.2f} | {b:.2f} | {(b - a) / a:+.1%}"


def served_tables(found: dict, keys: list, side_a: str, side_b: str) -> list[str]:
    """Each decoder layer as the layer op serves it on each side, and the projections whose path changed."""
    keys = _recording(found, keys, (side_a, side_b), "layer_op_picks")
    if not keys:
        return []
    by_layer = defaultdict(list)
    for key in keys:
        by_layer[key[:3] + key[4:]].append(key)  # the point without the projection
    lines = ["", "Per decoder layer as served (the one kernel up to each projection's row limit, the three kernels "
             f"past it; medians summed; rounds: those faster on {side_b}):", "",
             f"| line | shape | TP | slots | adapters | tokens | {side_a} | {side_b} | change | rounds | "
             "paths changed |",
             "|---" * 11 + "|"]  # fmt: skip
    for (line, shape, tp, tokens, adapters, slots), projections in by_layer.items():
        a = sum(_median(found[k][side_a], served_us) for k in projections)
        b = sum(_median(found[k][side_b], served_us) for k in projections)
        changed = []
        for k in projections:
            pick_a = next(iter(found[k][side_a].values()))["layer_op_picks"]
            pick_b = next(iter(found[k][side_b].values()))["layer_op_picks"]
            if pick_a != pick_b:
                changed.append(f"{k[3]}: {pick_a} → {pick_b}")
        rounds = _rounds_won(found, projections, side_a, side_b, served_us)
        lines.append(f"| {line} | {shape} | {tp} | {slots} | {adapters} | {tokens} | {_change(a, b)} | {rounds} | "
                     f"{'; '.join(changed)} |")  # fmt: skip
    return lines


def change_verdicts(found: dict, keys: list, side_a: str, side_b: str, min_gain: float) -> tuple[list[str], list]:
    """The plan-table changes between the sides, each judged on every timed batch it serves by the search's rule:
    side B's change holds where it takes more than `min_gain` less time summed over those batches. A table key's
    plan serves the batches of its row tile sized for its adapters (`plans.plan_adapters`; the one kernel's times);
    a projection's row limit, the batches between the two limits (times as served). Returns the tables' lines and
    the changes that held, as (section, table key, the key's `decode_plan` arguments or None)."""
    from vllm_bdlora.kernels.plans import decode_key, mixed_rows_key, plan_adapters, row_tile

    keys = _recording(found, keys, (side_a, side_b), "width")
    plan_keys, limit_keys = defaultdict(list), defaultdict(list)
    for key in keys:
        row = next(iter(found[key][side_a].values()))
        total_width = row["width"] * row["slices"]
        sized = plan_adapters(row["slots"], row["width"], row["tokens"], row["mixed_width"])
        lookup = (row["N"], row["K"], total_width, row["slots"], row_tile(row["tokens"]), sized)
        plan_keys[(key[0], key[1], key[2], key[3], ("decode", decode_key(*lookup), lookup))].append(key)
        if "layer_op_picks" in row and row["slots"] > 1:
            rows_key = ("mixed_rows", mixed_rows_key(row["N"], row["K"], total_width), None)
            limit_keys[(key[0], key[1], key[2], key[3], rows_key)].append(key)
    lines, held = [], []
    for title, groups, time, differs in (
        ("table key (its plan's one-kernel time over the batches it serves)", plan_keys,
         lambda row: row["one_launch_us"], lambda row: row["plan"]),
        ("row limit (the batches between the two limits, as served)", limit_keys, served_us,
         lambda row: row["layer_op_picks"]),
    ):  # fmt: skip
        rows = []
        for (line, shape, tp, layer, change), served in groups.items():
            table_key = change[1]
            # the batches the change touches: all of a key's (they share its plan), a limit's between the two
            points = [k for k in served if {differs(r) for r in found[k][side_a].values()}
                      != {differs(r) for r in found[k][side_b].values()}]  # fmt: skip
            if not points:
                continue
            a = sum(_median(found[k][side_a], time) for k in points)
            b = sum(_median(found[k][side_b], time) for k in points)
            verdict = side_b if b < a * (1 - min_gain) else side_a
            if verdict == side_b:
                held.append(change)
            batches = ", ".join(f"{k[4]}x{k[5]}" for k in points)
            rows.append(f"| {line} | {shape} | {tp} | {layer} | {table_key} | {batches} | {_change(a, b)} | "
                        f"{_rounds_won(found, points, side_a, side_b, time)} | **{verdict}** |")  # fmt: skip
        if rows:
            lines += ["", f"Changes per {title}: **{side_b}** where it takes more than {min_gain:.0%} less time "
                      "summed, else **" + side_a + "**:", "",
                      f"| line | shape | TP | layer | key | batches (tokens x adapters) | {side_a} | {side_b} | change "
                      "| rounds | holds |", "|---" * 11 + "|", *rows]  # fmt: skip
    return lines, held


def assemble(held: list, after_path: str, into_path: str) -> list[str]:
    """Write into the table at `into_path` (the table before, as the old side ran it) the changes that held, each
    as the table at `after_path` (the new side's) serves it: a key's plan as that table looks it up (where it came
    from another entry, a key falling back to it, it is written under the key itself, so that no other batch size
    changes), a row limit as it is. Returns a line per change."""
    from bench.kernels.decode_lora import describe
    from vllm_bdlora.kernels.plans import PlanTable

    with open(after_path) as f:
        after = PlanTable.from_json(f.read(), after_path)
    with open(into_path) as f:
        into = PlanTable.from_json(f.read(), into_path)
    said = []
    for section, key, lookup in dict.fromkeys(held):
        if section == "decode":
            plan = after.decode_plan(*lookup)
            into.decode[key] = replace(plan, row_gather=False) if plan is not None else None  # not a table choice
        elif key in after.mixed_rows:
            into.mixed_rows[key] = after.mixed_rows[key]
        else:
            raise SystemExit(f"{after_path} has no row limit {key}: --assemble takes the table the new side ran")
        said.append(f"{key}: {describe(into.decode[key]) if section == 'decode' else into.mixed_rows[key]}")
    with open(into_path, "w") as f:
        f.write(into.to_json())
    return said


def as_table_runs(row: dict, table) -> tuple[str, str]:
    """(plan, path) of a timed batch's projection under `table`, as bench.kernels.decode_lora records them for the
    table it ran with."""
    from bench.kernels.decode_lora import describe, served_path

    plan, one_kernel = served_path(table, row["N"], row["K"], row["width"] * row["slices"], row["slots"],
                                   row["tokens"], row["slices"], row["mixed_width"])  # fmt: skip
    return describe(plan), "one launch" if one_kernel else "three kernels"


def table_tables(found: dict, keys: list, side_a: str, side_b: str, table_path: str) -> list[str]:
    """Each decoder layer under the table at `table_path`, from the side each projection's batch runs as under it."""
    from vllm_bdlora.kernels.plans import PlanTable

    with open(table_path) as f:
        table = PlanTable.from_json(f.read(), table_path)
    keys = _recording(found, keys, (side_a, side_b), "width", "layer_op_picks")
    by_layer = defaultdict(list)
    for key in keys:
        runs = as_table_runs(next(iter(found[key][side_a].values())), table)
        sides = [side for side in (side_a, side_b)
                 if all((row["plan"], row["layer_op_picks"]) == runs for row in found[key][side].values())]  # fmt: skip
        if not sides:
            raise SystemExit(f"{table_path}: {key[3]} at {key[4]} tokens, {key[5]} adapters ({key[0]}) runs "
                             f"{runs[1]} with {runs[0]}, as on neither side")  # fmt: skip
        by_layer[key[:3] + key[4:]].append((key, sides[0]))
    lines = ["", f"Per decoder layer under `{os.path.basename(table_path)}` (as served; each projection's times from "
             f"the side it runs as under that table, {side_a} where both do):", "",
             f"| line | shape | TP | slots | adapters | tokens | {side_a} | table | change | from {side_b} |",
             "|---" * 10 + "|"]  # fmt: skip
    for (line, shape, tp, tokens, adapters, slots), projections in by_layer.items():
        a = sum(_median(found[k][side_a], served_us) for k, _ in projections)
        b = sum(_median(found[k][side], served_us) for k, side in projections)
        taken = ", ".join(k[3] for k, side in projections if side == side_b)
        lines.append(f"| {line} | {shape} | {tp} | {slots} | {adapters} | {tokens} | {_change(a, b)} | {taken} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="folder holding the runs (e.g. the unpacked switch.tgz's switch/)")
    p.add_argument("--sides", default="0,1", help="side A (before), side B (after), as the folders name them")
    p.add_argument("--out", help="write the markdown here too")
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="a table change holds where it takes more than this fraction less time (the searches' rule)",
    )
    p.add_argument("--table", help="a plan table assembled from the changes that held: each decoder layer under it")
    p.add_argument("--assemble", metavar="AFTER", help="first write into --table (the table before) the changes that "
                   "held, from AFTER (the table the new side ran, e.g. search-rounds' tables/)")  # fmt: skip
    args = p.parse_args(argv)
    if args.assemble and not args.table:
        p.error("--assemble AFTER writes into --table: give the table before (e.g. the checkout's configs/ table)")
    side_a, side_b = args.sides.split(",")
    text = tables(read_runs(args.runs), side_a, side_b, args.min_gain, args.table, args.assemble)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

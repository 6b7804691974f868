"""Two sides of a decode-kernel change, alternated round by round on one host: per-projection medians and the rounds
each side won, from `gpu_host.sh switch` runs (or any folders of `bench.kernels.decode_lora` results).

Every `decode_lora.json` under RUNS is read; its folder's path names the side and the round as `SIDE-rROUND` (the
rest of the path names the benchmark line): `0-r3/tp4_8/decode_lora.json` is side 0, round 3, line tp4_8;
`8b-new-r1/decode_lora.json` is side new, round 1, line 8b. Rounds pair the sides, so a host that drifts during the
call moves both (the switch runs them in alternating order), and "rounds" counts the pairs where B was faster.

    python -m bench.kernels.switch_table RUNS --sides 0,1 [--out RUNS/switch.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections import defaultdict

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


def tables(found: dict, side_a: str, side_b: str) -> str:
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
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="folder holding the runs (e.g. the unpacked switch.tgz's switch/)")
    p.add_argument("--sides", default="0,1", help="side A (before), side B (after), as the folders name them")
    p.add_argument("--out", help="write the markdown here too")
    args = p.parse_args(argv)
    side_a, side_b = args.sides.split(",")
    text = tables(read_runs(args.runs), side_a, side_b)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

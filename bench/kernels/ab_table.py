"""Old code vs new through the layer op, side by side: tables from `gpu_host.sh ab` runs.

Each side is one or more run folders (e.g. old1, old2 and new1, new2 of one host, run old, new, new, old so drift
and warm-up hit both), each holding a folder per benchmark line with its `fused_lora.csv`. Per projection it lists
every run's layer-op time and the LoRA time (layer op less its base GEMM, means over the side's runs); per decoder
layer, the four projections summed.

    python -m bench.kernels.ab_table --side old=ab/old1,ab/old2 --side new=ab/new1,ab/new2 --out ab.md
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from collections import defaultdict

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def read_side(run_dirs: list[str]) -> dict:
    """{(line, tp, width, tokens, adapters, layer): {"op": [ms per run], "gemm": [ms per run]}}"""
    found = defaultdict(lambda: {"op": [], "gemm": []})
    for run in run_dirs:
        for line in sorted(os.listdir(run)):
            path = os.path.join(run, line, "fused_lora.csv")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                for row in csv.DictReader(f):
                    key = (line, int(row["tp"]), int(row["width"]), int(row["tokens"]), int(row["adapters"]),
                           row["layer"])  # fmt: skip
                    found[key]["op"].append(float(row["layer_op_ms"]) * 1e3)
                    found[key]["gemm"].append(float(row["base_gemm_only_ms"]) * 1e3)
    return found


def lora_us(point: dict) -> float:
    return statistics.mean(point["op"]) - statistics.mean(point["gemm"])


def tables(sides: dict[str, dict]) -> str:
    (old_name, old), (new_name, new) = list(sides.items())[:2]
    keys = sorted(set(old) & set(new), key=lambda k: (k[0], k[3], k[4], PROJECTIONS.index(k[5])))
    runs = lambda ms: ", ".join(f"{v:.1f}" for v in ms)  # noqa: E731
    lines = [
        f"| line | layer | tokens | adapters | base GEMM µs | {old_name} µs (runs) | {new_name} µs (runs) | "
        f"LoRA µs {old_name} → {new_name} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    per_layer = defaultdict(lambda: [0.0, 0.0, 0.0, 0, 0.0, 0.0])
    for key in keys:
        line, _, _, tokens, adapters, layer = key
        gemm = statistics.mean(old[key]["gemm"] + new[key]["gemm"])
        before, after = lora_us(old[key]), lora_us(new[key])
        lines.append(f"| {line} | {layer} | {tokens} | {adapters} | {gemm:.1f} | {runs(old[key]['op'])} | "
                     f"{runs(new[key]['op'])} | {before:.1f} → {after:.1f} |")  # fmt: skip
        total = per_layer[(line, tokens, adapters)]
        total[0] += gemm
        total[1] += before
        total[2] += after
        total[3] += 1
        total[4] += statistics.mean(old[key]["op"])
        total[5] += statistics.mean(new[key]["op"])
    lines += [
        "",
        f"| line | tokens | adapters | base GEMMs µs | LoRA µs per decoder layer {old_name} → {new_name} | whole "
        f"layer op µs per decoder layer {old_name} → {new_name} |",
        "|---|---|---|---|---|---|",
    ]
    for (line, tokens, adapters), (gemm, before, after, count, op_before, op_after) in per_layer.items():
        if count == len(PROJECTIONS):
            change = f" ({(after - before) / before:+.0%})" if before > 0 else ""
            lines.append(f"| {line} | {tokens} | {adapters} | {gemm:.0f} | {before:.0f} → {after:.0f}{change} | "
                         f"{op_before:.1f} → {op_after:.1f} ({(op_after - op_before) / op_before:+.1%}) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", action="append", required=True,
                        help="NAME=RUN_DIR[,RUN_DIR...]: two of these, the old side first")  # fmt: skip
    parser.add_argument("--out", help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    if len(args.side) != 2:
        parser.error("give exactly two --side (old first, then new)")
    sides = {}
    for spec in args.side:
        name, _, dirs = spec.partition("=")
        if not dirs:
            parser.error(f"--side {spec!r}: expected NAME=RUN_DIR[,RUN_DIR...]")
        sides[name] = read_side(dirs.split(","))
        if not sides[name]:
            parser.error(f"--side {spec!r}: no fused_lora.csv found under {dirs}")
    text = tables(sides)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""The three-kernel path's shrink split at decode sizes: our shrink with the hidden dimension cut into each
power-of-two number of parts, then the fused expand summing those parts as it loads S, timed together (the
base GEMM, the same whatever the split, is left out). More parts spread the shrink's A reads over more SMs,
but every expand program reads every part of its rows' S: at width 512 and 16 parts, gate_up_proj's expand
programs at TP=1 read 16 × 512 floats per row each. The GPU's plan table picks the split; this shows what the
others would cost, per layer of Llama-3.1-8B's (or --model-shape's) per-GPU shapes at --tp, BD r' --bd-rank.

    python -m bench.kernels.shrink_split --tp 1 --bd-rank 512 --tokens 1,16,64 --adapters 1,4 --out DIR

The three kernels run at decode sizes where the one-launch kernel does not: batches mixing several adapter
slots, and layers the plan table leaves to them (gate_up_proj at TP=1 from r'=256). Times: median of 100
CUDA-event-timed replays of a CUDA graph of 10 calls, bf16, expand adding onto an existing output (what the
layer op does below 2048 tokens); each split's result is checked against the default's first. GB/s: the
bytes the pair must move at least (X, A and B of each adapter used, the output read and written) over the
fastest split's time, against the host's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from bench.kernels.fused_lora import adapter_bytes, add_layer_grid_arguments, layer_grid, make_layer, run_bd_rank
from bench.kernels.harness import finish, kernel_bench_cli, report_start, time_cuda, write_report, write_results

SPLITS = (1, 2, 4, 8, 16)


def split_config(default, hidden: int, split: int):
    """The default shrink configuration with another split, its hidden step no longer than a part."""
    from vllm_bdlora.kernels.plans import shrink_hidden_step

    return replace(default, split_k=split, block_k=min(default.block_k, shrink_hidden_step(hidden, split)))


def split_point(tp, layer_name, k, heights, tokens, adapters, width, copy_gbs) -> dict:
    from bench.kernels.fused_lora import table_launch
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink

    layer = make_layer(k, heights, tokens, adapters, width)
    x, lora_a, lora_b = layer["x"], layer["lora_a"], layer["lora_b"]
    groups, widths, bounds = layer["groups"], layer["widths"], layer["bounds"]
    base = x @ layer["weight"].T
    launch = table_launch(layer)
    default = launch.shrink

    def pair(config, out):
        fused_expand(out, lora_shrink(x, lora_a, groups, widths, config=config), lora_b, groups, widths, bounds,
                     config=launch.expand)  # fmt: skip
        return out

    expected = pair(default, base.clone()).float()
    row = {"tp": tp, "layer": layer_name, "tokens": tokens, "adapters": adapters, "width": width,
           "default_split": default.split_k}  # fmt: skip
    times = {}
    for split in SPLITS:
        if k // split < 64:
            continue
        config = split_config(default, k, split)
        got = pair(config, base.clone()).float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        out = base.clone()
        timed = time_cuda(lambda config=config, out=out: pair(config, out), trials=100, graph_repeats=10)
        times[split] = round(timed["median_ms"] * 1e3, 2)
        row[f"split{split}_us"] = times[split]
    best = min(times, key=times.get)
    moved = 2 * (x.numel() + 2 * base.numel()) + adapter_bytes(tokens, adapters, k, heights, width)
    row.update(best_split=best, default_over_best=round(times[default.split_k] / times[best], 3),
               best_gbs=round(moved / (times[best] * 1e-6) / 1e9, 1))  # fmt: skip
    row["best_of_copy_bw"] = round(row["best_gbs"] / copy_gbs, 3)
    print(row, flush=True)
    return row


def report(json_path: str) -> str:
    _, rows, lines = report_start(
        json_path, lambda rows: f"The three-kernel path's shrink split at decode sizes (BD r'={run_bd_rank(rows)})"
    )
    lines += [
        "- µs: shrink + fused expand (adding onto the output), median of 100 CUDA-event-timed replays of a CUDA "
        "graph of 10 calls, per call; bf16; the base GEMM left out; tokens dealt round robin over the adapters",
        "- default = the split the plan table picks (bold); best = the fastest; GB/s = bytes moved at least (X, A "
        "and B of each adapter used, the output read and written) over the best time, and its share of the copy "
        "bandwidth",
        "",
        "| TP | layer | width | tokens | adapters | "
        + " | ".join(f"split {s} µs" for s in SPLITS)
        + " | default | best | default / best | best GB/s (of copy) |",
        "|---|---|---|---|---|" + "---|" * (len(SPLITS) + 4),
    ]
    for r in rows:
        cells = []
        for split in SPLITS:
            us = r.get(f"split{split}_us")
            cells.append("-" if us is None else f"**{us}**" if split == r["default_split"] else str(us))
        lines.append(
            f"| {r['tp']} | {r['layer']} | {r['width']} | {r['tokens']} | {r['adapters']} | "
            + " | ".join(cells)
            + f" | {r['default_split']} | {r['best_split']} | {r['default_over_best']} | {r['best_gbs']} "
            f"({r['best_of_copy_bw']:.0%}) |"
        )
    return write_report(json_path, "shrink_split", lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_grid_arguments(p, tp="1", tokens="1,16,64")
    started = kernel_bench_cli(p, argv, report, "shrink_split")
    if started is None:
        return 0
    args, copy_gbs, chosen_report, name = started
    rows = []
    for tp, layer_name, k, heights, t, a in layer_grid(args):
        rows.append(split_point(tp, layer_name, k, heights, t, a, args.bd_rank // tp, copy_gbs))
        # a call cut short by the host's time limit still leaves what it measured
        write_results(args.out, name, rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})
    return finish(args.out, name, rows, copy_gbs, chosen_report)


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a LoRA-adapted layer's time goes, kernel by kernel (the whole-layer benchmark, fused_lora.py, only
shows sums): the base GEMM as cuBLAS runs it alone and accumulating onto an existing output (beta = 1), our
shrink and expand (in place, and writing the delta), and vLLM's shrink and expand, at Llama-3.1-8B per-GPU shapes
(TP=4 unless --tp), bf16, one adapter per batch or, with --adapters, several (tokens dealt round robin) in layers of
--slots slots: which kernel a batch that mixes adapters costs more in. `--configs` also ranks our kernels' launch
configurations.

Two candidates timed here before were measured and dropped (bench/results/README.md, archived H200 runs): a
K-augmented prefill layer (one cuBLAS GEMM over [X | S]·[W | B]ᵀ) and a single-pass decode kernel (the shrink
inside the expand). Their code is in git history (commit d20fd56).

    python -m bench.kernels.lora_breakdown --out bench/results/kernels/lora-breakdown-h200
    python -m bench.kernels.lora_breakdown --width 8 --slots 12 --adapters 1,4,12 --tokens 16,64 --out DIR

Times: median of CUDA-event-timed replays of a CUDA graph of 10 calls. Streaming kernels also report GB/s
(the bytes they must move: output read and/or written, S, X for the shrink) against the measured copy
bandwidth.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import torch

from bench.kernels.fused_lora import WIDTH, layers, make_layer, vllm_lora_inputs
from bench.kernels.harness import copy_bandwidth_gbs, time_cuda, write_results

TOKENS = (1, 16, 64, 1024, 8192)


def kernels(layer):
    """(name, fn, bytes it must move or None) for every kernel of the layer on its own."""
    from bench.kernels.fused_lora import table_launch
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink

    x, w, groups, widths, bounds = layer["x"], layer["weight"], layer["groups"], layer["widths"], layer["bounds"]
    tokens, n = x.shape[0], w.shape[0]
    y = x @ w.T
    launch = table_launch(layer)
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths, launch.shrink)
    expand, mixed = replace(launch.expand, mixed_tiles=False), replace(launch.expand, mixed_tiles=True)
    out_bytes = 2 * tokens * n
    found = [
        ("cublas_gemm", lambda: x @ w.T, None),
        ("cublas_gemm_beta1", lambda: y.addmm_(x, w.t()), None),
        ("our_shrink", lambda: lora_shrink(x, layer["lora_a"], groups, widths, launch.shrink), 2 * x.numel()),
        ("our_expand_in_place", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds,
                                                     config=expand), 2 * out_bytes),
        ("our_expand_write", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, config=expand,
                                                  overwrite=True), out_bytes),
        # the same launch with mixed tiles (rows of any adapters in one tile) rather than a tile per adapter's rows
        ("our_expand_in_place_mixed_tiles", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds,
                                                                 config=mixed), 2 * out_bytes),
        ("our_expand_write_mixed_tiles", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds,
                                                              config=mixed, overwrite=True), out_bytes),
    ]  # fmt: skip
    inputs = vllm_lora_inputs(layer)
    if inputs is None:
        return found
    lora_a, lora_b, args = inputs
    buffer = torch.empty(len(lora_a), tokens, lora_b[0].shape[-1], dtype=torch.float32, device=x.device)
    found += [
        ("vllm_shrink", lambda: torch.ops.vllm.lora_shrink(x, lora_a, buffer, *args, 1.0), 2 * x.numel()),
        ("vllm_expand", lambda: torch.ops.vllm.lora_expand(buffer, lora_b, y, *args, offset_start=0, add_inputs=True),
         2 * out_bytes),
    ]  # fmt: skip
    return found


def ranked(configs, launch, moved_bytes: int, rate_key: str) -> list[dict]:
    """Each launch configuration timed (graph replays), fastest first, with the rate it moved `moved_bytes`."""
    timed = []
    for cfg in configs:
        us = time_cuda(lambda cfg=cfg: launch(cfg), trials=50, graph_repeats=10)["median_ms"] * 1e3
        timed.append({**asdict(cfg), "us": round(us, 2), rate_key: round(moved_bytes / (us * 1e-6) / 1e9, 1)})
    return sorted(timed, key=lambda t: t["us"])


def expand_configs(layer) -> list[dict]:
    """Our expand (writing the delta) under a grid of launch configurations: which tile shapes stream."""
    from bench.kernels.fused_lora import table_launch
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink
    from vllm_bdlora.kernels.plans import LaunchConfig

    x, groups, widths, bounds = layer["x"], layer["groups"], layer["widths"], layer["bounds"]
    y = torch.empty(x.shape[0], layer["weight"].shape[0], dtype=x.dtype, device=x.device)
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths, table_launch(layer).shrink)
    configs = [LaunchConfig(bm, bn, 32, num_warps=warps, num_stages=stages)
               for bm in (16, 32, 64, 128) for bn in (64, 128, 256)
               for warps in (4, 8) for stages in (1, 2)]  # fmt: skip

    def launch(cfg):
        return fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, config=cfg, overwrite=True)

    return ranked(configs, launch, y.numel() * 2, "gbs")


def shrink_configs(layer) -> list[dict]:
    """Our shrink under a grid of launch configurations (tile rows, one column block per slice or one for
    all slices, hidden-dimension split)."""
    from vllm_bdlora.kernels.fused_lora import lora_shrink
    from vllm_bdlora.kernels.plans import LaunchConfig, all_slices_block

    x, groups, widths = layer["x"], layer["groups"], layer["widths"]
    width = layer["lora_b"].shape[2]
    whole = all_slices_block(width, widths.shape[0])
    configs = [LaunchConfig(bm, bn, bk, split_k=split, num_warps=4, num_stages=3)
               for bm in (16, 32, 64, 128) for bn in sorted({min(whole, width), whole}) for split in (1, 2, 4, 8, 16)
               for bk in (64, 128) if x.shape[1] // split >= bk]  # fmt: skip
    return ranked(configs, lambda cfg: lora_shrink(x, layer["lora_a"], groups, widths, config=cfg), x.numel() * 2,
                  "x_gbs")  # fmt: skip


def breakdown_point(args, name, k, heights, tokens, adapters) -> dict:
    """Every kernel of one layer at one batch, timed on its own."""
    layer = make_layer(k, heights, tokens, adapters, args.width, slots=max(args.slots, adapters))
    row = {"tp": args.tp, "layer": name, "tokens": tokens, "adapters": adapters, "width": args.width,
           "slots": max(args.slots, adapters)}  # fmt: skip
    timed = kernels(layer)
    for kernel, fn, moved in timed:
        us = time_cuda(fn, trials=100, graph_repeats=10)["median_ms"] * 1e3
        row[f"{kernel}_us"] = round(us, 2)
        if moved:
            row[f"{kernel}_gbs"] = round(moved / (us * 1e-6) / 1e9, 1)
    if args.configs:
        for kernel, ranked in (("expand_write", expand_configs(layer)), ("shrink", shrink_configs(layer))):
            row[f"{kernel}_top5"], row[f"{kernel}_worst"] = ranked[:5], ranked[-1]
    print(row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--configs", action="store_true", help="also time our kernels' launch configurations")
    p.add_argument("--tp", type=int, default=4, help="Llama-3.1-8B per-GPU layer shapes at this TP")
    p.add_argument("--width", type=int, default=WIDTH, help=f"per-GPU LoRA width (default {WIDTH}: BD r'=128 at TP=4)")
    p.add_argument("--adapters", default="1", help="adapters per batch (tokens dealt round robin)")
    p.add_argument("--slots", type=int, default=0, help="LoRA slots of every layer, a server's --max-loras "
                   "(default: the batch's adapters; never fewer)")  # fmt: skip
    args = p.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for name, k, heights in layers(args.tp):
        for adapters in map(int, args.adapters.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                rows.append(breakdown_point(args, name, k, heights, tokens, adapters))
                # after every point: a call cut short by the host's time limit still leaves what it measured
                path = write_results(args.out, "lora_breakdown", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

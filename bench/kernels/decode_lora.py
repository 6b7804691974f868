"""Decode-sized batches through a whole adapted layer: the one-launch kernel (kernels/decode_lora.py)
against the layer op's three-kernel path (cuBLAS GEMM, routed shrink, fused expand) and the base GEMM
alone, at Llama-3.1-8B per-GPU shapes for TP = 1, 2, 4 with BD r'=128 (per-GPU LoRA width 128 / TP).

    python -m bench.kernels.decode_lora --out bench/results/kernels-h200-s11

Both LoRA paths are the custom op BD layers call (`fused_lora_slices_` over an unquantized base), without
and with the layer's decode state; each is checked against the torch reference first. Times: median of 200
CUDA-event-timed replays of a CUDA graph of 10 calls (serving replays graphs), bf16. GB/s: the bytes each
path must read and write at least (W, X, the output, and A and B of every adapter in the batch) over its
time, against the host's measured copy bandwidth. `over_base`: the path's time over the base GEMM's.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.fused_lora import layer_op_path, make_layer, reference
from bench.kernels.harness import kernel_bench_cli, time_cuda, write_results

HIDDEN, INTERMEDIATE, Q_HEADS_DIM, KV_DIM = 4096, 14336, 4096, 1024  # Llama-3.1-8B


def layers(tp: int):
    """(name, K, output slice heights) per GPU at this TP."""
    return (
        ("qkv_proj", HIDDEN, (Q_HEADS_DIM // tp, KV_DIM // tp, KV_DIM // tp)),
        ("o_proj", Q_HEADS_DIM // tp, (HIDDEN,)),
        ("gate_up_proj", HIDDEN, (INTERMEDIATE // tp, INTERMEDIATE // tp)),
        ("down_proj", INTERMEDIATE // tp, (HIDDEN,)),
    )


def bench_point(tp, name, k, heights, tokens, adapters, copy_gbs):
    from vllm_bdlora.kernels.decode_lora import new_decode_state
    from vllm_bdlora.kernels.fused_lora import group_tokens

    width = 128 // tp
    layer = make_layer(k, heights, tokens, adapters, width)
    want = reference(layer)
    n = sum(heights)
    no_adapter = {**layer, "slots": torch.full_like(layer["slots"], -1)}
    no_adapter["groups"] = group_tokens(no_adapter["slots"], adapters)
    paths = {
        "base_gemm": lambda: layer["x"] @ layer["weight"].T,
        "three_kernels": layer_op_path(layer),
        "one_launch": layer_op_path(layer, new_decode_state(layer["lora_a"].shape[1], "cuda")),
        # the kernel's GEMV and barrier without LoRA work: what its LoRA part costs on top
        "one_launch_no_adapter": layer_op_path(no_adapter, new_decode_state(layer["lora_a"].shape[1], "cuda")),
    }
    row = {"tp": tp, "layer": name, "tokens": tokens, "adapters": adapters, "K": k, "N": n, "width": width}
    used = min(adapters, tokens)
    lora_bytes = 2 * used * (len(heights) * width * k + n * width)
    for path, fn in paths.items():
        if path != "base_gemm":
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


def report(json_path: str) -> str:
    import json
    import os

    with open(json_path) as f:
        results = json.load(f)
    env, rows = results["environment"], results["rows"]
    lines = [
        "# One-launch decode kernel vs the three-kernel layer op (whole adapted layer, BD r'=128)",
        "",
        f"- GPU `{env['gpu']}`, torch `{env['torch']}`, triton `{env['triton']}`, {env['time']}; measured copy "
        f"bandwidth {results['copy_bandwidth_gbs']} GB/s",
        f"- command: `{env['command']}`",
        "- µs: median of 200 CUDA-event-timed replays of a CUDA graph of 10 calls, per call; bf16; Llama-3.1-8B "
        "per-GPU shapes; per-GPU LoRA width 128 / TP; tokens dealt round robin over the adapters",
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
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['layer']} | {r['tokens']} | {r['adapters']} | {r['base_gemm_us']} "
            f"({r['base_gemm_gbs']}) | {r['three_kernels_us']} ({r['three_kernels_over_base']}) | "
            f"**{r['one_launch_us']}** ({r['one_launch_over_base']}, {r['one_launch_gbs']}, "
            f"{r['one_launch_of_copy_bw']:.0%}) | {r['one_launch_speedup']}× | {r['one_launch_no_adapter_us']} "
            f"({r['one_launch_no_adapter_over_base']}) |"
        )
    lines += ["", "Per decoder layer (the four kinds summed), 1 adapter:", ""]
    lines += ["| TP | tokens | base µs | three kernels µs (×base) | one launch µs (×base) |", "|---|---|---|---|---|"]
    for tp in dict.fromkeys(r["tp"] for r in rows):
        for tokens in dict.fromkeys(r["tokens"] for r in rows):
            picked = [r for r in rows if r["tp"] == tp and r["tokens"] == tokens and r["adapters"] == 1]
            if not picked:
                continue
            base, three, one = (sum(r[f"{p}_us"] for r in picked) for p in ("base_gemm", "three_kernels", "one_launch"))
            lines.append(f"| {tp} | {tokens} | {base:.1f} | {three:.1f} ({three / base:.2f}) | {one:.1f} "
                         f"({one / base:.2f}) |")  # fmt: skip
    out = os.path.join(os.path.dirname(json_path), "decode_lora.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="4,2,1")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--adapters", default="1,4", help="adapters per batch (tokens dealt round robin)")
    started = kernel_bench_cli(p, argv, report, "decode_lora")
    if started is None:
        return 0
    args, copy_gbs = started
    rows = [
        bench_point(int(tp), name, k, heights, int(t), int(a), copy_gbs)
        for tp in args.tp.split(",")
        for name, k, heights in layers(int(tp))
        for a in args.adapters.split(",")
        for t in args.tokens.split(",")
    ]
    print(report(write_results(args.out, "decode_lora", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a LoRA-adapted layer's time goes, kernel by kernel (the whole-layer benchmark, fused_lora.py, only
shows sums): the base GEMM as cuBLAS runs it alone and accumulating onto an existing output (beta = 1), our
shrink and expand (in place, and writing the delta), and vLLM's shrink and expand, at Llama-3.1-8B TP=4
per-GPU shapes, one adapter, bf16. Also two candidates not used by the layers yet, each with its error
against the torch reference: the K-augmented layer for prefill (`kaug_*`: one cuBLAS GEMM over [X | S]·[W | B]ᵀ,
`k_augmented_operands`) with its speed-up over vLLM's GEMM + shrink + expand, and for decode batches the
single-pass LoRA kernel (`onepass_*`: `single_pass_lora`, shrink inside the expand) with its speed-up over our
shrink + in-place expand (`--configs` also ranks its launch configurations).

    python -m bench.kernels.lora_breakdown --out bench/results/kernels-h200

Times: median of CUDA-event-timed replays of a CUDA graph of 10 calls. Streaming kernels also report GB/s
(the bytes they must move: output read and/or written, S, X for the shrink) against the measured copy
bandwidth.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from bench.kernels.fused_lora import LAYERS, WIDTH, make_layer, reference, vllm_lora_inputs
from bench.kernels.harness import copy_bandwidth_gbs, time_cuda, write_results

TOKENS = (1, 16, 64, 1024, 8192)
SINGLE_PASS_MAX_TOKENS = 64  # decode batches: the single-pass kernel re-reads A per column block


def k_augmented_operands(x, weight, lora_b, slice_bounds):
    """Operands of the K-augmented layer for one adapter: out = [X | S]·[W | B']ᵀ, a single cuBLAS GEMM whose
    reduction dimension carries the LoRA rank too (S = X·Aᵀ from the shrink, slices side by side; B' holds
    slice j's B in slice j's output rows and S columns, zeros elsewhere). No output re-read, no expand; costs
    an X copy into the wider buffer and slices·width/K more FLOPs. A serving version would keep W as a view
    into B''s buffer (no weight copy) and have the shrink write S into the buffer's tail."""
    hidden, width = x.shape[1], lora_b.shape[2]
    bounds = [int(b) for b in slice_bounds]
    slices = len(bounds) - 1
    augmented = torch.zeros(weight.shape[0], hidden + slices * width, dtype=weight.dtype, device=weight.device)
    augmented[:, :hidden] = weight
    for j in range(slices):
        rows = slice(bounds[j], bounds[j + 1])
        augmented[rows, hidden + j * width : hidden + (j + 1) * width] = lora_b[0, rows]
    buffer = torch.empty(x.shape[0], hidden + slices * width, dtype=x.dtype, device=x.device)
    return buffer, augmented


def kernels(layer):
    """(name, fn, bytes it must move or None) for every kernel of the layer on its own."""
    from vllm_bdlora.kernels.fused_lora import fused_expand, lora_shrink, single_pass_lora

    x, w, groups, widths, bounds = layer["x"], layer["weight"], layer["groups"], layer["widths"], layer["bounds"]
    tokens, n = x.shape[0], w.shape[0]
    y = x @ w.T
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths)
    out_bytes = 2 * tokens * n
    found = [
        ("cublas_gemm", lambda: x @ w.T, None),
        ("cublas_gemm_beta1", lambda: y.addmm_(x, w.t()), None),
        ("our_shrink", lambda: lora_shrink(x, layer["lora_a"], groups, widths), 2 * x.numel()),
        ("our_expand_in_place", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds),
         2 * out_bytes),
        ("our_expand_write", lambda: fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, overwrite=True),
         out_bytes),
    ]  # fmt: skip
    if layer["lora_b"].shape[0] == 1:
        x_aug, w_aug = k_augmented_operands(x, w, layer["lora_b"], bounds.tolist())
        hidden = x.shape[1]

        def k_augmented_layer():  # S through a copy: the shrink does not yet write into the buffer's tail
            x_aug[:, :hidden].copy_(x)
            x_aug[:, hidden:].copy_(lora_shrink(x, layer["lora_a"], groups, widths).sum(0))
            return x_aug @ w_aug.T

        found += [
            ("kaug_copy_x", lambda: x_aug[:, :hidden].copy_(x), 2 * x.numel() * 2),
            ("kaug_gemm", lambda: x_aug @ w_aug.T, None),
            ("kaug_layer", k_augmented_layer, None),
        ]
    if tokens <= SINGLE_PASS_MAX_TOKENS:
        found.append(("onepass_lora", lambda: single_pass_lora(y, x, layer["lora_a"], layer["lora_b"], groups, widths,
                                                               bounds), 2 * out_bytes))  # fmt: skip
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
    from vllm_bdlora.kernels.fused_lora import LaunchConfig, fused_expand, lora_shrink

    x, groups, widths, bounds = layer["x"], layer["groups"], layer["widths"], layer["bounds"]
    y = torch.empty(x.shape[0], layer["weight"].shape[0], dtype=x.dtype, device=x.device)
    shrunk = lora_shrink(x, layer["lora_a"], groups, widths)
    configs = [LaunchConfig(bm, bn, 32, num_warps=warps, num_stages=stages)
               for bm in (16, 32, 64, 128) for bn in (64, 128, 256)
               for warps in (4, 8) for stages in (1, 2)]  # fmt: skip

    def launch(cfg):
        return fused_expand(y, shrunk, layer["lora_b"], groups, widths, bounds, config=cfg, overwrite=True)

    return ranked(configs, launch, y.numel() * 2, "gbs")


def shrink_configs(layer) -> list[dict]:
    """Our shrink under a grid of launch configurations (tile rows, one column block per slice or one for
    all slices, hidden-dimension split)."""
    from vllm_bdlora.kernels.fused_lora import LaunchConfig, all_slices_block, lora_shrink

    x, groups, widths = layer["x"], layer["groups"], layer["widths"]
    whole = all_slices_block(WIDTH, widths.shape[0])
    configs = [LaunchConfig(bm, bn, bk, split_k=split, num_warps=4, num_stages=3)
               for bm in (16, 32, 64, 128) for bn in sorted({min(whole, WIDTH), whole}) for split in (1, 2, 4, 8, 16)
               for bk in (64, 128) if x.shape[1] // split >= bk]  # fmt: skip
    return ranked(configs, lambda cfg: lora_shrink(x, layer["lora_a"], groups, widths, config=cfg), x.numel() * 2,
                  "x_gbs")  # fmt: skip


def single_pass_configs(layer) -> list[dict]:
    """The single-pass kernel under a grid of launch configurations (column block: how often A is re-read)."""
    from vllm_bdlora.kernels.fused_lora import LaunchConfig, single_pass_lora

    x, groups, widths, bounds = layer["x"], layer["groups"], layer["widths"], layer["bounds"]
    y = torch.zeros(x.shape[0], layer["weight"].shape[0], dtype=x.dtype, device=x.device)
    configs = [LaunchConfig(16, bn, bk, num_warps=warps, num_stages=stages)
               for bn in (32, 64, 128, 256) for bk in (64, 128, 256)
               for warps in (2, 4, 8) for stages in (2, 3, 4)]  # fmt: skip

    def launch(cfg):
        return single_pass_lora(y, x, layer["lora_a"], layer["lora_b"], groups, widths, bounds, config=cfg)

    return ranked(configs, launch, y.numel() * 4, "gbs")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest deviation from the reference layer's output, relative to its largest value."""
    return round(float((got.float() - expected).abs().max() / expected.abs().max()), 5)


def single_pass_layer(layer) -> torch.Tensor:
    """The whole layer through the single-pass kernel, on a fresh base GEMM output (the timed closure
    accumulates onto the same output call after call)."""
    from vllm_bdlora.kernels.fused_lora import single_pass_lora

    x, w = layer["x"], layer["weight"]
    return single_pass_lora(x @ w.T, x, layer["lora_a"], layer["lora_b"], layer["groups"], layer["widths"],
                            layer["bounds"])  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--configs", action="store_true", help="also time our kernels' launch configurations")
    args = p.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for name, k, heights in LAYERS:
        for tokens in map(int, args.tokens.split(",")):
            layer = make_layer(k, heights, tokens, 1, WIDTH)
            row = {"layer": name, "tokens": tokens}
            timed = kernels(layer)
            for kernel, fn, moved in timed:
                us = time_cuda(fn, trials=100, graph_repeats=10)["median_ms"] * 1e3
                row[f"{kernel}_us"] = round(us, 2)
                if moved:
                    row[f"{kernel}_gbs"] = round(moved / (us * 1e-6) / 1e9, 1)
            # the candidates must compute the layer before their times mean anything
            expected = reference(layer).float() if "kaug_layer_us" in row or "onepass_lora_us" in row else None
            if "kaug_layer_us" in row:
                k_augmented_layer = next(fn for kernel, fn, _ in timed if kernel == "kaug_layer")
                row["kaug_rel_error"] = relative_error(k_augmented_layer(), expected)
                if "vllm_expand_us" in row:
                    vllm_us = row["cublas_gemm_us"] + row["vllm_shrink_us"] + row["vllm_expand_us"]
                    row["kaug_speedup_vs_vllm"] = round(vllm_us / row["kaug_layer_us"], 3)
            if "onepass_lora_us" in row:
                row["onepass_rel_error"] = relative_error(single_pass_layer(layer), expected)
                for against, pair in (("ours", ("our_shrink_us", "our_expand_in_place_us")),
                                      ("vllm", ("vllm_shrink_us", "vllm_expand_us"))):  # fmt: skip
                    if all(key in row for key in pair):
                        speedup = (row[pair[0]] + row[pair[1]]) / row["onepass_lora_us"]
                        row[f"onepass_speedup_vs_{against}"] = round(speedup, 3)
            if args.configs:
                if tokens <= SINGLE_PASS_MAX_TOKENS:
                    ranked_single = single_pass_configs(layer)
                    row["onepass_top5"], row["onepass_worst"] = ranked_single[:5], ranked_single[-1]
                for kernel, ranked in (("expand_write", expand_configs(layer)), ("shrink", shrink_configs(layer))):
                    row[f"{kernel}_top5"], row[f"{kernel}_worst"] = ranked[:5], ranked[-1]
            print(row, flush=True)
            rows.append(row)
            # after every point: a call cut short by the host's time limit still leaves what it measured
            path = write_results(args.out, "lora_breakdown", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""DoRA compose kernel vs the unfused torch path, and the factored norm's memory vs the dense B·A path.

    python -m bench.kernels.dora_compose --out bench/results/kernels/dora-compose-h200

Compose: rows × cols in bf16 (rows 1…32768, cols 4096…28672), one adapter, no bias; bytes moved
(3·rows·cols + cols)·2; median of 200 CUDA-event trials after 10 warm-ups; achieved GB/s as a fraction of
the measured device copy bandwidth. Norm: peak GPU memory of `vllm_bdlora.dora.squared_row_norms`
against the dense ||W + s·B·A|| at d_in = 8192, r = 384.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.harness import copy_bandwidth_gbs, time_cuda, write_results
from bench.plots import save_png

ROWS = (1, 512, 2048, 4096, 8192, 16384, 32768)
COLS = (4096, 8192, 14336, 28672)


def unfused_compose(base, lora, g):
    """What one writes in torch without the kernel (same formula, one op at a time)."""
    return base + (g - 1) * base + g * lora


def bench_compose(rows_list, cols_list, copy_gbs: float) -> list[dict]:
    from vllm_bdlora.kernels.dora_compose import dora_compose
    from vllm_bdlora.kernels.reference import dora_compose_reference

    out_rows = []
    for cols in cols_list:
        for rows in rows_list:
            base = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            lora = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.1
            table = 0.5 + torch.rand(1, cols, device="cuda")
            slots = torch.zeros(rows, dtype=torch.long, device="cuda")
            out = torch.empty_like(base)
            g = table[0].to(torch.bfloat16)
            torch.testing.assert_close(
                dora_compose(base, lora, table, slots, out=out),
                dora_compose_reference(base, lora, table, slots),
                atol=2e-2,
                rtol=2e-2,
            )
            args = (base, lora, table, slots)
            fused = time_cuda(lambda a=args, o=out: dora_compose(*a, out=o))
            unfused = time_cuda(lambda b=base, lo=lora, gv=g: unfused_compose(b, lo, gv))
            moved = (3 * rows * cols + cols) * 2
            gbs = moved / (fused["median_ms"] * 1e-3) / 1e9
            out_rows.append(
                {
                    "rows": rows,
                    "cols": cols,
                    "fused_ms": round(fused["median_ms"], 5),
                    "unfused_ms": round(unfused["median_ms"], 5),
                    "speedup": round(unfused["median_ms"] / fused["median_ms"], 3),
                    "fused_gbs": round(gbs, 1),
                    "fraction_of_copy_bw": round(gbs / copy_gbs, 3),
                }
            )
            print(out_rows[-1], flush=True)
    return out_rows


def peak_memory_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_norm_memory(d_out: int = 8192, d_in: int = 8192, rank: int = 384) -> dict:
    from vllm_bdlora.dora import squared_row_norms

    weight = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02
    lora_a = torch.randn(rank, d_in, device="cuda", dtype=torch.bfloat16) * 0.02
    lora_b = torch.randn(d_out, rank, device="cuda", dtype=torch.bfloat16) * 0.02
    scaling = 2.0

    def dense():
        return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).norm(dim=1).square()

    factored_result = squared_row_norms(weight, lora_a, lora_b, scaling)
    torch.testing.assert_close(factored_result, dense(), rtol=1e-3, atol=1e-3)
    factored = peak_memory_mib(lambda: squared_row_norms(weight, lora_a, lora_b, scaling))
    dense_mib = peak_memory_mib(dense)
    return {
        "d_out": d_out,
        "d_in": d_in,
        "rank": rank,
        "factored_peak_mib": round(factored, 1),
        "dense_peak_mib": round(dense_mib, 1),
        "memory_ratio": round(dense_mib / factored, 2),
        "factored_ms": round(
            time_cuda(lambda: squared_row_norms(weight, lora_a, lora_b, scaling), 20, 3)["median_ms"], 3
        ),
        "dense_ms": round(time_cuda(dense, 20, 3)["median_ms"], 3),
    }


def plot(rows: list[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for cols in sorted({r["cols"] for r in rows}):
        sel = [r for r in rows if r["cols"] == cols]
        xs = [r["rows"] for r in sel]
        axes[0].plot(xs, [r["fraction_of_copy_bw"] for r in sel], marker="o", label=f"cols {cols}")
        axes[1].plot(xs, [r["speedup"] for r in sel], marker="o", label=f"cols {cols}")
    axes[0].set(xscale="log", xlabel="rows (tokens)", ylabel="fraction of copy bandwidth", title="fused compose")
    axes[1].set(xscale="log", xlabel="rows (tokens)", ylabel="× faster than unfused torch", title="speed-up")
    for ax in axes:
        ax.axhline(0.8 if ax is axes[0] else 2.0, color="grey", ls="--", lw=1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, f"{out_dir}/dora_compose.png", dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--cols", default=",".join(map(str, COLS)))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (kernel timings are CUDA-event timings)")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    rows = bench_compose([int(x) for x in args.rows.split(",")], [int(x) for x in args.cols.split(",")], copy_gbs)
    norm = bench_norm_memory()
    print(norm, flush=True)
    write_results(args.out, "dora_compose", rows, {"copy_bandwidth_gbs": round(copy_gbs, 1), "norm_memory": norm})
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

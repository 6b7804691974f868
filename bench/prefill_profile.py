"""Where a LoRA prefill's time goes: one long prompt at a time, host against GPU, base model against BD-LoRA.

    python -m bench.prefill_profile --out bench/results/prefill/tp1-llama3.1-8b-h100 [--tokens 1024]
        [--cases base,bd-eager,bd-graphs,nfs-eager] [--workdir /root/bench]

Each case is a fresh offline engine (vLLM's `LLM`, in-process, Llama shape with dummy weights, TP=1) in a process of
its own, sent one prompt of `--tokens` tokens at a time with one output token, so every measured step is a prefill:

* `base`: no LoRA; `bd-*`: a BD adapter (r'=128, the serving sweep's) on the fused kernels; `nfs-eager`: a standard
  r=64 adapter on vLLM's LoRA kernels;
* `*-eager`: vLLM's own CUDA graph range (2 x max_num_seqs, at most 512 tokens), so the prompt's step runs the
  compiled model eagerly; `*-graphs`: graphs captured up to 2048 tokens, what a BD-LoRA `vllm serve` asks for when
  the user set no range (`prefill_graph_tokens`, vllm_bdlora/prefill_graphs.py); the base case keeps vLLM's range.

Per case: the median time of a request (prefill + one sampled token, offline: no HTTP), then a torch-profiler pass
over a few requests: GPU busy time per request (kernel time summed) against its wall time (the rest is the GPU
waiting for the host), the LoRA layer op's calls and host time per call, kernel time by kind (GEMMs, attention,
LoRA kernels, the rest) and the case's top kernels by GPU time. Writes prefill_profile.{json,md}. It measures the
mechanism; the serving sweep measures what users see (TTFT through `vllm serve`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "base": {"lora": None, "graphs": None},
    "bd-eager": {"lora": "bd", "graphs": None},
    "bd-graphs": {"lora": "bd", "graphs": 2048},
    "nfs-eager": {"lora": "nfs", "graphs": None},
}
BD_RANK, NFS_RANK = 128, 64
TIMED, PROFILED, WARM_UPS = 20, 5, 3
OUR_KERNELS = ("_routed_shrink_kernel", "_fused_expand_kernel", "_decode_lora_linear_kernel", "_dora_compose_kernel")
LORA_OP = "vllm_bdlora::fused_lora_slices_"
TOP_KERNELS, KERNEL_NAME_CHARS = 15, 90  # each case's kernels by GPU time: which of them the LoRA time is


def kernel_kind(name: str) -> str:
    """Inductor names its generated kernels after the ops they fuse (`triton_poi_fused_fused_lora_slices__mul_silu`
    is the base's SiLU-and-multiply reading our op's output): those are the model's own elementwise work, never
    LoRA. FlashAttention's kernels are CUTLASS templates: attention is matched before GEMMs."""
    lower = name.lower()
    if any(k in name for k in OUR_KERNELS):
        return "lora_ours"
    if lower.startswith("triton_"):
        return "other"
    if "lora" in lower:
        return "lora_vllm"
    if any(k in lower for k in ("flash", "attn", "attention", "fmha")):
        return "attention"
    if any(k in lower for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    return "other"


def with_current_kinds(row: dict) -> dict:
    """`row` with the time of each kernel it lists moved to the kind `kernel_kind` gives it now (a case measured
    under older rules; the kernels past its top list keep their recorded kind)."""
    row = dict(row)
    for kernel in row.get("top_kernels", []):
        kind = kernel_kind(kernel["name"])
        if kind != kernel["kind"]:
            row[f"{kernel['kind']}_ms"] -= kernel["ms_per_request"]
            row[f"{kind}_ms"] += kernel["ms_per_request"]
    row["top_kernels"] = [k | {"kind": kernel_kind(k["name"])} for k in row.get("top_kernels", [])]
    return row


def run_case(name: str, args) -> dict:
    """One case in this process (the engine in-process, so the profiler sees the worker)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the CPU backend (a smoke run): a small fixed KV cache
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from bench.adapters import write_adapter
    from bench.shapes import SHAPES, make_dummy_model
    from vllm_bdlora.compat import allowed_max_lora_ranks

    case = CASES[name]
    shape = SHAPES[args.model_shape]
    model = make_dummy_model(args.model_shape, os.path.join(args.workdir, args.model_shape))
    kwargs = {"load_format": "dummy", "max_model_len": args.tokens + 64}
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.85
    compilation = {"max_cudagraph_capture_size": case["graphs"]} if case["graphs"] else {}
    lora_request = None
    if case["lora"]:
        rank, nblocks = (BD_RANK, 1) if case["lora"] == "bd" else (NFS_RANK, None)
        kind = f"bd{nblocks}" if nblocks else "std"
        path = write_adapter(shape, os.path.join(args.workdir, f"adapters-{args.model_shape}", f"{kind}-r{rank}-0"),
                             rank, nblocks, 0)  # fmt: skip
        kwargs |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in allowed_max_lora_ranks()
                                                                              if r >= rank)}  # fmt: skip
        if case["lora"] == "bd":
            # prefill_graph_tokens 0: the plugin's own capture range is what the -graphs case sets explicitly.
            kwargs["additional_config"] = {"bdlora": {"lora_kernels": "fused", "prefill_graph_tokens": 0}}
        lora_request = LoRARequest("a0", 1, path)
    started = time.perf_counter()
    llm = LLM(model=model, compilation_config=compilation, **kwargs)
    start_s = time.perf_counter() - started
    capture = llm.llm_engine.vllm_config.compilation_config.max_cudagraph_capture_size
    generator = torch.Generator().manual_seed(0)
    vocab = min(shape.vocab_size, 30000)

    def one_request():
        ids = torch.randint(10, vocab, (args.tokens,), generator=generator).tolist()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, ignore_eos=True),
                     lora_request=lora_request, use_tqdm=False)  # fmt: skip

    for _ in range(WARM_UPS):
        one_request()
    timings = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        one_request()
        timings.append((time.perf_counter() - t0) * 1e3)
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED):
            one_request()
        sync()
    profiled_ms = (time.perf_counter() - t0) * 1e3 / PROFILED
    kinds = dict.fromkeys(("gemm", "attention", "lora_ours", "lora_vllm", "other"), 0.0)
    op_calls, op_host_us = 0, 0.0
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if str(getattr(event, "device_type", "")).endswith("CUDA") and device_us:
            kind = kernel_kind(event.key)
            kinds[kind] += device_us / 1e3 / PROFILED
            kernels.append({"name": event.key[:KERNEL_NAME_CHARS], "kind": kind,
                            "calls_per_request": round(event.count / PROFILED, 1),
                            "ms_per_request": round(device_us / 1e3 / PROFILED, 3)})  # fmt: skip
        if event.key == LORA_OP:
            op_calls += event.count
            op_host_us += event.cpu_time_total
    gpu_busy = sum(kinds.values())
    return {
        "case": name, "tokens": args.tokens, "model_shape": args.model_shape, "lora": case["lora"] or "none",
        "max_cudagraph_capture_size": capture, "engine_start_s": round(start_s, 1),
        "request_ms_median": round(statistics.median(timings), 2), "request_ms_min": round(min(timings), 2),
        "profiled_request_ms": round(profiled_ms, 2), "gpu_busy_ms": round(gpu_busy, 2),
        "gpu_waiting_ms": round(profiled_ms - gpu_busy, 2),
        **{f"{k}_ms": round(v, 3) for k, v in kinds.items()},
        "lora_op_calls_per_request": op_calls // PROFILED,
        "lora_op_host_us_per_call": round(op_host_us / op_calls, 1) if op_calls else 0.0,
        "lora_op_host_ms_per_request": round(op_host_us / 1e3 / PROFILED, 2),
        "top_kernels": sorted(kernels, key=lambda k: -k["ms_per_request"])[:TOP_KERNELS],
    }  # fmt: skip


def write_report(out: str, rows: list[dict], command: str) -> str:
    """prefill_profile.md from the cases' rows, on the machine `out/environment.json` names (written by the run)."""
    with open(os.path.join(out, "environment.json")) as f:
        env = json.load(f)
    rows = [with_current_kinds(r) for r in rows]
    base = next((r for r in rows if r["case"] == "base"), None)
    lines = [
        f"# Prefill profile: {rows[0]['model_shape']}, TP=1, one {rows[0]['tokens']}-token prompt at a time",
        "",
        f"- GPU `{env['gpus'][0]}`, vLLM `{env['vllm']}`, torch `{env['torch']}`, {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"- command: `{command}`",
        "- request: prefill + one sampled token through vLLM's offline engine (no HTTP); median of "
        f"{TIMED}; GPU busy = kernel time summed over {PROFILED} profiled requests (the profiler's own overhead "
        "lengthens their wall time a little), waiting = profiled wall − busy.",
        "",
        "| case | graphs up to | request ms | × base | GPU busy ms | GPU waiting ms | GEMM ms | attention ms | "
        "LoRA kernels ms | other ms | LoRA op calls | host µs per LoRA op | engine start s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['request_ms_median'] / base['request_ms_median']:.2f}" if base else "-"
        lora_ms = r["lora_ours_ms"] + r["lora_vllm_ms"]
        lines.append(
            f"| {r['case']} | {r['max_cudagraph_capture_size']} | {r['request_ms_median']:.1f} | {ratio} | "
            f"{r['gpu_busy_ms']:.1f} | {r['gpu_waiting_ms']:.1f} | {r['gemm_ms']:.1f} | {r['attention_ms']:.1f} | "
            f"{lora_ms:.1f} | {r['other_ms']:.1f} | {r['lora_op_calls_per_request']} | "
            f"{r['lora_op_host_us_per_call']:.0f} | {r['engine_start_s']:.0f} |"
        )  # fmt: skip
    for r in rows:
        lines += ["", f"## {r['case']}: kernels by GPU time (top {TOP_KERNELS}, per request)", "",
                  "| kernel | kind | calls | ms |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| `{k['name']}` | {k['kind']} | {k['calls_per_request']:g} | {k['ms_per_request']:.3f} |"
                  for k in r.get("top_kernels", [])]  # fmt: skip
    path = os.path.join(out, "prefill_profile.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--cases", default="base,bd-eager,bd-graphs,nfs-eager")
    p.add_argument("--workdir", default="/tmp/bdlora-bench")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite prefill_profile.md from the case-*.json files already in --out, measuring nothing",
    )
    p.add_argument("--run-case", help=argparse.SUPPRESS)  # internal: one case, in a process of its own
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        return report_only(args.out, args.cases.split(","))
    if args.run_case:
        row = run_case(args.run_case, args)
        with open(os.path.join(args.out, f"case-{args.run_case}.json"), "w") as f:
            json.dump(row, f, indent=1)
        return 0
    from bench.run_record import environment

    with open(os.path.join(args.out, "environment.json"), "w") as f:
        json.dump(environment(), f, indent=1)
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            p.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        log = os.path.join(args.out, f"case-{name}.log")
        print(f"[prefill] {name} ...", flush=True)
        with open(log, "w") as f:
            command = [sys.executable, "-m", "bench.prefill_profile", *given, "--run-case", name]
            rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
        result = os.path.join(args.out, f"case-{name}.json")
        if rc or not os.path.exists(result):
            print(f"[prefill] {name} failed (rc={rc}), see {log}", flush=True)
            continue
        with open(result) as f:
            rows.append(json.load(f))
        print(f"[prefill] {name}: {rows[-1]['request_ms_median']} ms per request, GPU busy {rows[-1]['gpu_busy_ms']} "
              f"ms", flush=True)  # fmt: skip
    if not rows:
        return 1
    with open(os.path.join(args.out, "prefill_profile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    command = "python -m bench.prefill_profile " + " ".join(given)
    print(open(write_report(args.out, rows, command)).read())
    return 0 if len(rows) == len(args.cases.split(",")) else 1


def report_only(out: str, cases: list[str]) -> int:
    rows = []
    for name in cases:
        path = os.path.join(out, f"case-{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
    if not rows:
        print(f"no case-*.json of {', '.join(cases)} in {out}")
        return 1
    rows = [with_current_kinds(r) for r in rows]
    with open(os.path.join(out, "prefill_profile.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(
        open(write_report(out, rows, f"python -m bench.prefill_profile --out {out} --cases {','.join(cases)}")).read()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

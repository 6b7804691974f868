"""The many-adapter benchmark: one server per mode, N adapters loaded into it, then workloads run against it in turn
(`bench/workload.py`: popularity, arrivals, lengths); per workload every request's timing, the run's summary, and the
server's own figures from its /metrics (`vllm_bdlora.metrics`: GPU-slot and host-cache hit rates, adapter loads by
kind and duration, engine step times).

    python -m bench.many_adapters --model-shape llama-3.1-8b --tp 4 --modes bdlora,nfs,slora --adapters 1024 \\
        --rank 16 --gpu-memory 2GiB --host-memory 16GiB \\
        --workloads "zipf:1.0 poisson:4 fixed:1024/128 400" "single poisson:4 fixed:1024/128 400" \\
                    "distinct concurrency:16 fixed:1024/128 160" "distinct concurrency:1 fixed:1024/128 24" \\
        --out bench/results/many-adapters/tp4-llama3.1-8b-h200

A workload is "POPULARITY ARRIVALS LENGTHS REQUESTS". Modes: base (no adapters: every request to the base model),
bdlora (BD r' = the paper's pair of --rank, nblocks = TP, vllm-bdlora's default kernels), nfs (standard r, vLLM's
default LoRA), slora (standard r, --fully-sharded-loras). Equal memory: every mode gets the same LoRA GPU memory per
GPU (--gpu-memory) and host memory per worker (--host-memory): the BD server takes them as its own budgets
(`--lora-gpu-memory`, `--adapter-host-memory`; the plugin turns them into slots and spills what does not fit), a stock
server as the --max-loras and --max-cpu-loras they hold of its adapters (`vllm_bdlora.sizing`, whole adapters in every
worker's cache). Both are recorded. Adapters: --distinct-files different weight files, every other adapter a hard link
to one of them (the load path does not know; the page cache holds them, as in the paper's F.4 setting).

Writes `summary.json`, `summary.md`, `requests.csv` (every request), `servers.json` (each mode's command and the
slots and cache entries it had), `environment.json` and `plots/`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.adapters import bd_rank_for, write_adapter
from bench.sampled_stacks import recording
from bench.shapes import SHAPES, make_dummy_model
from bench.workload import plan, run, summarise, timings_rows
from vllm_bdlora.serve.process import free_port, launch, stop_server, tail, wait_gpu_memory_released, wait_healthy

MODES = ("base", "bdlora", "nfs", "slora")
LOADS_AT_ONCE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.many_adapters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--modes", default="bdlora,nfs,slora")
    p.add_argument("--adapters", type=int, default=1024, help="N adapters loaded into every LoRA server")
    p.add_argument("--rank", type=int, default=16, help="standard rank r; BD adapters take the paper's pair r'")
    p.add_argument("--distinct-files", type=int, default=16)
    p.add_argument("--workloads", nargs="+", required=True, help='"POPULARITY ARRIVALS LENGTHS REQUESTS" each')
    p.add_argument("--gpu-memory", default="2GiB", help="LoRA GPU memory per GPU, the same for every mode")
    p.add_argument("--host-memory", default="16GiB", help="host memory for adapters per worker, the same for all")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds; goodput counts requests within it")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lora-target-modules", default="qkv_proj,o_proj,gate_up_proj,down_proj",
                   help="given to every LoRA server ('' for vLLM's default: embeddings and lm_head too)")  # fmt: skip
    p.add_argument("--extra-server-args", default="", help="appended to every vllm serve command")
    p.add_argument("--workdir", default="/tmp/bdlora-many-adapters")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-load", action="store_true",
                   help="py-spy samples the server's processes while the adapters load (`bench.sampled_stacks`): "
                        "OUT/logs/load-profile-MODE-{all,gil}.txt")  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.mode_list = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    args.workload_specs = [parse_workload(w, p) for w in args.workloads]
    return args


def parse_workload(text: str, parser) -> dict:
    parts = text.split()
    if len(parts) != 4:
        parser.error(f"a workload is 'POPULARITY ARRIVALS LENGTHS REQUESTS', got {text!r}")
    return {"popularity": parts[0], "arrivals": parts[1], "lengths": parts[2], "requests": int(parts[3]),
            "label": "_".join(parts).replace(":", "").replace("/", "-")}  # fmt: skip


def mode_adapter(args, mode: str) -> tuple[int, int | None]:
    """(rank, nblocks) of a mode's adapters."""
    return (bd_rank_for(args.rank), args.tp) if mode == "bdlora" else (args.rank, None)


def write_adapter_set(args, mode: str) -> tuple[list[str], list[str]]:
    """The N adapters of `mode` on disk: (names, paths); --distinct-files real ones, the rest hard links."""
    rank, nblocks = mode_adapter(args, mode)
    kind = f"bd{nblocks}-r{rank}" if nblocks else f"lora-r{rank}"
    root = os.path.join(args.workdir, f"adapters-{args.model_shape}-{kind}")
    shape = SHAPES[args.model_shape]
    distinct = min(args.distinct_files, args.adapters)
    originals = [write_adapter(shape, os.path.join(root, "files", f"f{i:03d}"), rank, nblocks, seed=100 + i)
                 for i in range(distinct)]  # fmt: skip
    names, paths = [], []
    for i in range(args.adapters):
        name, path = f"a{i:05d}", os.path.join(root, f"a{i:05d}")
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            os.makedirs(path, exist_ok=True)
            source = originals[i % distinct]
            shutil.copyfile(os.path.join(source, "adapter_config.json"), os.path.join(path, "adapter_config.json"))
            os.link(os.path.join(source, "adapter_model.safetensors"), os.path.join(path, "adapter_model.safetensors"))
        names.append(name)
        paths.append(path)
    return names, paths


def slot_images_kept() -> bool:
    """Whether a BD server here keeps admitted adapters as slot images: its fused kernels run (`lora_kernels` "auto",
    the default, picks them on a CUDA GPU)."""
    import torch

    return torch.cuda.is_available()


def budgets(args, mode: str) -> dict:
    """What the same GPU and host memory mean for `mode`: its slots, its host-cache entries, and the bytes."""
    from bench.adapters import trainable_params
    from vllm_bdlora.compat import allowed_max_lora_ranks
    from vllm_bdlora.config import parse_bytes
    from vllm_bdlora.sizing import slot_cost, slots_that_fit

    shape_spec = SHAPES[args.model_shape]
    shape = shape_spec.sizing_shape(args.dtype)
    gpu, host = parse_bytes(args.gpu_memory, "--gpu-memory"), parse_bytes(args.host_memory, "--host-memory")
    rank, nblocks = mode_adapter(args, mode)
    max_lora_rank = next(r for r in allowed_max_lora_ranks() if r >= rank and r % args.tp == 0)
    vocabulary = not args.lora_target_modules
    layout = {"bdlora": "bd", "nfs": "nfs", "slora": "slora"}.get(mode, "nfs")
    cost = slot_cost(shape, max_lora_rank, args.tp, layout=layout, vocabulary=vocabulary)
    element = 2 if args.dtype in ("float16", "bfloat16") else 4
    adapter_bytes = trainable_params(shape_spec, rank, nblocks) * element
    per_worker = adapter_bytes // args.tp if mode == "bdlora" else adapter_bytes  # BD: each worker keeps its share
    if mode == "bdlora" and slot_images_kept():
        # as a slot's image at the adapter's width (`vllm_bdlora.slot_arena`: the power of two holding its share of
        # the rank, at most the slot's), zeros past it, which the host budget counts too
        from vllm_bdlora.slot_arena import image_width_for

        slot_width = max_lora_rank // args.tp
        image_width = image_width_for([rank // args.tp], slot_width)
        per_worker = max(per_worker, cost.projections * image_width // slot_width)
    return {
        "gpu_memory_bytes": gpu, "host_memory_bytes": host, "max_lora_rank": max_lora_rank,
        "slot_bytes": cost.total, "max_loras": slots_that_fit(gpu, cost),
        "adapter_bytes": adapter_bytes, "host_bytes_per_adapter": per_worker,
        "host_entries": max(1, host // max(1, per_worker)),
    }  # fmt: skip


def serve_command(args, mode: str, model: str, port: int, budget: dict) -> list[str]:
    command = ["vllm", "serve", model, "--load-format", "dummy", "--tensor-parallel-size", str(args.tp),
               "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    if mode != "base":
        command += ["--max-lora-rank", str(budget["max_lora_rank"])]
        if args.lora_target_modules:
            command += ["--lora-target-modules", *args.lora_target_modules.split(",")]
        if mode == "bdlora":
            command += ["--enable-bdlora", "--lora-gpu-memory", str(budget["gpu_memory_bytes"]),
                        "--adapter-host-memory", str(budget["host_memory_bytes"])]  # fmt: skip
        else:
            command += ["--enable-lora", "--max-loras", str(max(1, budget["max_loras"])),
                        "--max-cpu-loras", str(max(budget["max_loras"], budget["host_entries"]))]  # fmt: skip
            if mode == "slora":
                command.append("--fully-sharded-loras")
    return command + shlex.split(args.extra_server_args)


def server_commands(args) -> list[list[str]]:
    """Every `vllm serve` command a run of `args` starts, the model and the port as placeholders (`bench.dry_run`)."""
    return [serve_command(args, mode, "MODEL", 8000, budgets(args, mode)) for mode in args.mode_list]


def load_adapters(url: str, names: list[str], paths: list[str]) -> float:
    """Load every adapter at runtime, LOADS_AT_ONCE at a time; returns the seconds it took."""
    import requests

    def load(item):
        name, path = item
        response = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                 timeout=1800)  # fmt: skip
        if response.status_code != 200:
            raise RuntimeError(f"loading {name}: HTTP {response.status_code} {response.text[:300]}")

    started = time.monotonic()
    with ThreadPoolExecutor(LOADS_AT_ONCE) as pool:
        list(pool.map(load, zip(names, paths, strict=True)))
    return time.monotonic() - started


def scrape(url: str) -> dict:
    from vllm_bdlora.serve.top import read_metrics

    try:
        return read_metrics(url, None)
    except Exception:
        return {}


def settled_scrape(url: str, tries: int = 5) -> dict:
    """The server's figures once they have caught up with an idle engine. The API server refreshes the workers' counts
    every METRICS_POLL_S, so a scrape right after a workload misses its last steps (and the next workload would count
    them): scrape until the engine's lookup and step counts stop moving across one refresh."""
    from vllm_bdlora.metrics import METRICS_POLL_S

    def moving(figures):
        return {
            name: figures.get(name)
            for name in ("vllm:lora_cache_lookups_total", "vllm_bdlora:engine_step_seconds_count")
        }

    figures = scrape(url)
    for _ in range(tries):
        time.sleep(METRICS_POLL_S + 0.5)
        later = scrape(url)
        if moving(later) == moving(figures):
            return later
        figures = later
    return figures


def server_figures(before: dict, after: dict) -> dict:
    """What the server saw during one workload, from two scrapes of its /metrics: hit rates, loads by kind (count,
    mean, p99), a step's own slot fills by cause, waiting requests held out of a step by reason, engine step times
    (p50, p99)."""
    from vllm_bdlora.metrics import CLOCKS
    from vllm_bdlora.serve.top import by_label, quantile

    def grown(name, label, **fixed):
        now, then = by_label(after, name, label, **fixed), by_label(before, name, label, **fixed)
        return {k: v - then.get(k, 0) for k, v in now.items()}

    figures = {}
    lookups, hits = grown("vllm:lora_cache_lookups_total", "level"), grown("vllm:lora_cache_hits_total", "level")
    for level in ("gpu", "cpu"):
        if lookups.get(level):
            figures[f"{level}_hit_rate"] = hits.get(level, 0) / lookups[level]
            figures[f"{level}_misses"] = lookups[level] - hits.get(level, 0)
    counts = grown("vllm_bdlora:adapter_loads_total", "kind")
    sums = grown("vllm_bdlora:adapter_load_seconds_sum", "kind")
    for kind, count in counts.items():
        if count:
            buckets = {}
            for labels, value in after.get("vllm_bdlora:adapter_load_seconds_bucket", {}).items():
                labels = dict(labels)
                if labels.get("kind") == kind:
                    earlier = before.get("vllm_bdlora:adapter_load_seconds_bucket", {}).get(
                        frozenset(labels.items()), 0
                    )
                    buckets[labels["le"]] = value - earlier
            figures[f"loads_{kind}"] = count
            figures[f"load_{kind}_mean_ms"] = sums.get(kind, 0) / count * 1e3
            figures[f"load_{kind}_p99_ms"] = quantile(buckets, 0.99) * 1e3
    for cause, count in grown("vllm_bdlora:slot_fills_in_step_total", "cause").items():
        if count:
            figures[f"in_step_{cause}"] = count
    for reason, count in grown("vllm_bdlora:requests_held_total", "reason").items():
        figures[f"held_{reason}"] = count
    admitted = counts.get("admission")
    for clock in CLOCKS:  # one admission's stages, on the first worker's admission threads
        spent = grown("vllm_bdlora:admission_stage_seconds_total", "stage", clock=clock)
        for stage, seconds in spent.items():
            if admitted and seconds:
                figures[f"admission_{stage}_{clock}_ms"] = seconds / admitted * 1e3
    steps = {}
    for labels, value in after.get("vllm_bdlora:engine_step_seconds_bucket", {}).items():
        steps[dict(labels)["le"]] = value - before.get("vllm_bdlora:engine_step_seconds_bucket", {}).get(labels, 0)
    if steps and max(steps.values()) > 0:
        figures["step_p50_ms"] = quantile(steps, 0.5) * 1e3
        figures["step_p99_ms"] = quantile(steps, 0.99) * 1e3
        figures["steps"] = max(steps.values())
    return figures


def run_mode(args, mode: str, model: str, vocab: int, writer, csv_file) -> tuple[list[dict], dict]:
    names, paths = write_adapter_set(args, mode) if mode != "base" else ([], [])
    budget = budgets(args, mode) if mode != "base" else {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.out, "logs", f"server_{mode}.log")
    command = serve_command(args, mode, model, port, budget)
    print(f"[many] starting {mode}: {' '.join(command)}", flush=True)
    server = {"mode": mode, "command": " ".join(command), **budget}
    rows = []
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # the adapters are loaded at runtime
    proc = launch(command, log_path, args.tp, env)
    try:
        started = time.monotonic()
        wait_healthy(proc, url, log_path, args.start_timeout)
        server["start_s"] = round(time.monotonic() - started, 1)
        if names:
            before_load = settled_scrape(url)
            profile = os.path.join(args.out, "logs", f"load-profile-{mode}")
            with recording(proc.pid, profile) if args.profile_load else contextlib.nullcontext():
                server["load_all_s"] = round(load_adapters(url, names, paths), 1)
            print(f"[many] {mode}: {len(names)} adapters loaded in {server['load_all_s']} s", flush=True)
            # where the load phase's time went: reads on admission threads, vLLM's add_lora in the engine loop
            server["load_figures"] = server_figures(before_load, settled_scrape(url))
        log = open(log_path, errors="replace").read()
        for line in log.splitlines():
            if "--max-loras" in line and "--lora-gpu-memory" in line:  # the plugin's sizing of the slots
                server["bd_slots_line"] = line.split("] ", 1)[-1]
        before = settled_scrape(url)  # each workload's figures start where the previous one's settled
        for spec in args.workload_specs:
            planned, tier_of = plan(spec["popularity"], spec["arrivals"], spec["lengths"], max(1, len(names)),
                                    spec["requests"], args.seed)  # fmt: skip
            if mode == "base":
                planned = [p.__class__(p.index, p.send_at, -1, p.input_len, p.output_len) for p in planned]
            timings, seconds = asyncio.run(run(url, names, planned, tier_of, spec["arrivals"], vocab,
                                               base_model=model, seed=args.seed))  # fmt: skip
            after = settled_scrape(url)
            figures = server_figures(before, after)
            before = after
            row = {"mode": mode, "adapters": len(names), "workload": spec["label"], **spec,
                   **summarise(timings, seconds, args.ttft_slo), **figures}  # fmt: skip
            rows.append(row)
            for timing in timings_rows(timings):
                writer.writerow({"mode": mode, "workload": spec["label"], **timing})
            csv_file.flush()
            print(f"[many] {mode} {spec['label']}: {row['completed']}/{row['requests']} ok, "
                  f"{row['output_tokens_per_s']:.0f} tok/s, ttft p50 {row['all_ttft_p50_ms']:.0f} "
                  f"p99 {row['all_ttft_p99_ms']:.0f} ms, tpot p50 {row['all_tpot_p50_ms']:.1f} ms",
                  flush=True)  # fmt: skip
    except (RuntimeError, TimeoutError) as e:
        server["failure"] = str(e).splitlines()[0]
        print(f"[many] {mode} failed: {e}\n{tail(log_path, 20)}", flush=True)
    finally:
        stop_server(proc)
        wait_gpu_memory_released()
    return rows, server


REQUEST_COLUMNS = ("mode", "workload", "index", "adapter", "rank", "tier", "input_len", "output_len", "sent",
                   "ttft", "tpot", "e2e", "tokens", "status", "error")  # fmt: skip


def main(argv=None) -> int:
    from bench.run_record import record_environment

    args = parse_args(argv)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    record_environment(args.out, "bench.many_adapters", sys.argv[1:] if argv is None else argv)
    model = make_dummy_model(args.model_shape, os.path.join(args.workdir, args.model_shape))
    vocab = SHAPES[args.model_shape].vocab_size
    rows, servers = [], []
    with open(os.path.join(args.out, "requests.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for mode in args.mode_list:
            mode_rows, server = run_mode(args, mode, model, vocab, writer, f)
            rows += mode_rows
            servers.append(server)
            write_results(args.out, rows, servers)  # after every mode: a run cut short keeps what it measured
    return 0 if rows and not any("failure" in s for s in servers) else 1


def write_results(out: str, rows: list[dict], servers: list[dict]) -> None:
    from bench.many_report import write_report

    with open(os.path.join(out, "servers.json"), "w") as f:
        json.dump(servers, f, indent=1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    write_report(out)


if __name__ == "__main__":
    sys.exit(main())

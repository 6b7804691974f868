"""One command, one serving sweep: base vs NFS-LoRA vs S-LoRA vs BD-LoRA, side by side in one run.

    python -m bench.sweep --model-shape llama-3.1-8b --tp 4 --out bench/results/serving/tp4-llama3.1-8b-h200

For every server configuration (mode, TP, rank, number of adapters) it starts `vllm serve` once, waits
for /health (with a timeout, failing early if the engine dies), runs `vllm bench serve` for every
(input/output length, concurrency) point, stops the server and waits for GPU memory to be released.
Results: `points.csv` (one row per point, appended as it goes), `raw/*.json` (vllm bench serve's own
output), `logs/`, then `summary.md` and `plots/` (bench/report.py, also runnable alone).

Modes: base (no LoRA) · nfs (vLLM's default LoRA) · slora (--fully-sharded-loras) · bdlora (--enable-bdlora)
· bddora (the bdlora adapters plus DoRA magnitude vectors, served with --enable-dora) · bdfused (bdlora on
vllm-bdlora's fused LoRA kernels). bdlora and bddora name {"lora_kernels": "vllm"} and bdfused "fused" in
--additional-config, whatever the plugin's default.
Ranks are the BD-LoRA paper's pairs: standard r for nfs/slora, BD r' for bdlora/bddora (bench/adapters.py;
equal trainable parameters at nblocks = 4, not at 1, 2 or 8).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass

from bench.adapters import PAPER_RANK_PAIRS, bd_rank_for, trainable_params, write_adapter
from bench.load_generators import GENERATORS, LABELS, normalise, run_point
from bench.run_record import record_environment
from bench.shapes import SHAPES, make_dummy_model
from vllm_bdlora.serve.process import free_port, launch, stop_server, tail, wait_gpu_memory_released, wait_healthy

MODES = ("base", "nfs", "slora", "bdlora", "bddora", "bdfused")
BD_MODES = ("bdlora", "bddora", "bdfused")
# Each BD mode names its LoRA kernels, so a mode means the same whatever the plugin's default.
BD_KERNELS = {"bdlora": "vllm", "bddora": "vllm", "bdfused": "fused"}
DEFAULT_MAX_LORAS = 4
LLMPERF_MIN_INPUT = 32

COLUMNS = (
    "mode", "tp", "rank", "trainable_params", "input_len", "output_len", "concurrency", "num_adapters",
    "median_tpot_ms", "median_ttft_ms", "median_e2el_ms", "output_throughput",
    "p99_tpot_ms", "p99_ttft_ms", "completed", "num_prompts", "model_shape", "load_generator", "raw_file",
    "median_itl_ms",
)  # fmt: skip


def points_so_far(csv_path: str) -> set[str]:
    """The raw-file names of the points a points.csv already holds. A file written with other columns (an
    older sweep's, resumed by this one) is rewritten with today's first, its rows kept, so that the rows
    appended next line up with its header."""
    if not os.path.exists(csv_path):
        return set()
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = tuple(reader.fieldnames or ())
    if header and header != COLUMNS:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    return {os.path.basename(row["raw_file"]) for row in rows}


@dataclass(frozen=True)
class ServerConfig:
    mode: str
    tp: int
    rank: int  # 0 for base
    num_adapters: int  # 0 for base

    @property
    def label(self) -> str:
        return f"{self.mode}-tp{self.tp}-r{self.rank}-a{self.num_adapters}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--workdir", default="/tmp/bdlora-bench", help="dummy model and adapters go here")
    p.add_argument("--out", required=True, help="results folder (e.g. bench/results/<name>)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes")
    p.add_argument(
        "--ranks",
        default=",".join(map(str, PAPER_RANK_PAIRS)),
        help="standard ranks r; BD modes use the paper's paired r' (16->32, 64->128, 256->512)",
    )
    p.add_argument("--io", default="1024/128,128/1024", help="input/output token pairs")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--adapters", default="1,many", help="'1' = one adapter; 'many' = --many-adapters adapters")
    p.add_argument("--many-adapters", type=int, default=16, help="adapters in the 'many' setting (> --max-loras)")
    p.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS, help="GPU LoRA slots (vLLM --max-loras)")
    p.add_argument("--prompts-per-concurrency", type=int, default=4, help="num_prompts = max(12, this x BS)")
    p.add_argument("--nblocks", type=int, default=0, help="BD blocks; 0 = the TP size of each point")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--extra-server-args", default="", help="appended to every vllm serve command")
    p.add_argument(
        "--lora-target-modules",
        default="",
        help="comma-separated, given to every LoRA server (not base) as vLLM's --lora-target-modules, e.g. "
        "qkv_proj,o_proj,gate_up_proj,down_proj: vLLM then skips its LoRA on lm_head and the embeddings, which "
        "it otherwise runs on every step (bench/results/serving/tp1-llama3.1-8b-h200-projections-only)",
    )
    p.add_argument(
        "--bdlora-settings",
        type=json.loads,
        default={},
        help='a JSON object merged into every BD server\'s "bdlora" --additional-config section, e.g. '
        '{"one_launch_max_tokens":16} (no spaces, so it survives gpu_host.sh queue lines)',
    )
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument(
        "--stop-after-minutes",
        type=float,
        default=0,
        help="start no new server after this long (0 = no limit); rerun the same command to resume",
    )
    p.add_argument(
        "--load-generator",
        default="vllm",
        help="vllm = `vllm bench serve`; llmperf = LLMPerf from --llmperf-dir (see bench/load_generators.py); "
        "vllm,llmperf = both, one after the other against the same server at every point",
    )
    p.add_argument("--llmperf-dir", help="an LLMPerf checkout (with token_benchmark_ray.py)")
    p.add_argument("--llmperf-python", default="python", help="the interpreter of LLMPerf's own virtual environment")
    p.add_argument(
        "--profile-concurrency",
        default="",
        help="after a server's measured points, one more run per listed concurrency (one wave of requests) "
        "under vLLM's torch profiler: a kernel-time table per rank in <out>/profiles/<server>/*profiler_out*.txt "
        "(and traces beside them); never in points.csv, the profiler slows what it watches",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    args = p.parse_args(argv)
    args.load_generators = [g for g in args.load_generator.split(",") if g]
    unknown = [g for g in args.load_generators if g not in GENERATORS]
    if unknown or not args.load_generators or len(set(args.load_generators)) < len(args.load_generators):
        p.error(f"--load-generator: one or more of {', '.join(GENERATORS)}, each once (got {args.load_generator!r})")
    args.load_generator = args.load_generators[0]  # the one the summary's tables and plots are made from
    if args.profile_concurrency and "vllm" not in args.load_generators:
        p.error("--profile-concurrency drives vLLM's profiler through `vllm bench serve --profile`: "
                "use --load-generator vllm")  # fmt: skip
    if "llmperf" in args.load_generators:
        if not args.llmperf_dir or not os.path.exists(os.path.join(args.llmperf_dir, "token_benchmark_ray.py")):
            p.error(
                "--load-generator llmperf needs --llmperf-dir pointing at an LLMPerf checkout "
                "(git clone https://github.com/ray-project/llmperf; its own venv for --llmperf-python)"
            )
        if args.adapters != "1":
            p.error("LLMPerf sends every request to one model: use --adapters 1 with --load-generator llmperf")
        short = [pair for pair in args.io.split(",") if int(pair.split("/")[0]) < LLMPERF_MIN_INPUT]
        if short:
            p.error(f"LLMPerf's prompts open with a ~20-token instruction and it loops forever on a shorter "
                    f"fixed input length: use input lengths of at least {LLMPERF_MIN_INPUT} "
                    f"(got {','.join(short)})")  # fmt: skip
    return args


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def plan(args) -> list[ServerConfig]:
    configs = []
    adapter_counts = [args.many_adapters if a == "many" else int(a) for a in args.adapters.split(",")]
    for tp in csv_ints(args.tp):
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
            if mode == "base":
                configs.append(ServerConfig(mode, tp, 0, 0))
                continue
            for rank in csv_ints(args.ranks):
                served_rank = bd_rank_for(rank) if mode in BD_MODES else rank
                configs.extend(ServerConfig(mode, tp, served_rank, n) for n in adapter_counts)
    return configs


def adapter_nblocks(args, config: ServerConfig) -> int | None:
    return (args.nblocks or config.tp) if config.mode in BD_MODES else None


def adapter_paths(args, config: ServerConfig) -> dict[str, str]:
    shape = SHAPES[args.model_shape]
    nblocks = adapter_nblocks(args, config)
    dora = config.mode == "bddora"
    kind = (f"bd{nblocks}" if nblocks else "std") + ("-dora" if dora else "")
    return {
        f"a{i}": write_adapter(
            shape,
            # Written once and reused by later sweeps in the same workdir, so the shape is part of the name.
            os.path.join(args.workdir, f"adapters-{args.model_shape}", f"{kind}-r{config.rank}-{i}"),
            config.rank,
            nblocks,
            i,
            dora=dora,
        )
        for i in range(config.num_adapters)
    }


def point_name(config: ServerConfig, io: tuple[int, int], concurrency: int, generator: str = "vllm") -> str:
    suffix = "" if generator == "vllm" else f"_{generator}"
    return f"{config.label}_io{io[0]}-{io[1]}_bs{concurrency}{suffix}.json"


def max_lora_rank(config: ServerConfig) -> int:
    """Smallest rank vLLM accepts that fits the adapters."""
    from vllm_bdlora.compat import allowed_max_lora_ranks

    return next(r for r in allowed_max_lora_ranks() if r >= config.rank)


def serve_command(args, config: ServerConfig, model: str, adapters: dict[str, str], port: int) -> list[str]:
    command = ["vllm", "serve", model, "--load-format", "dummy", "--tensor-parallel-size", str(config.tp),
               "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--port", str(port),
               "--max-num-seqs", str(max(csv_ints(args.concurrency)))]  # fmt: skip
    if config.mode != "base":
        switch = {"bdlora": "--enable-bdlora", "bddora": "--enable-dora", "bdfused": "--enable-bdlora"}.get(
            config.mode, "--enable-lora"
        )
        command += [switch,
                    "--max-lora-rank", str(max_lora_rank(config)),
                    "--max-loras", str(min(args.max_loras, len(adapters))),
                    "--max-cpu-loras", str(max(len(adapters), args.max_loras)),
                    "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]]  # fmt: skip
        if args.lora_target_modules:
            command += ["--lora-target-modules", *args.lora_target_modules.split(",")]
        if config.mode == "slora":
            command.append("--fully-sharded-loras")
        if config.mode in BD_KERNELS:
            section = {"lora_kernels": BD_KERNELS[config.mode], **args.bdlora_settings}
            command += ["--additional-config", json.dumps({"bdlora": section})]
    if args.profile_concurrency:
        command += ["--profiler-config", profiler_config(args, config)]
    return command + shlex.split(args.extra_server_args)


def server_commands(args) -> list[list[str]]:
    """Every `vllm serve` command a sweep of `args` starts, model, adapters and port as placeholders
    (`bench.dry_run`)."""
    return [serve_command(args, config, "MODEL", {f"a{i}": f"ADAPTERS/a{i}" for i in range(config.num_adapters)}, 8000)
            for config in plan(args)]  # fmt: skip


# Engine steps the profiler records once started: a wave of 64 requests of 1024 tokens prefills in 8 steps
# of 8192 tokens, then decodes; 40 steps cover the prefill burst and the first decode steps after it.
PROFILED_STEPS = 40


def profile_dir(args, config: ServerConfig) -> str:
    return os.path.abspath(os.path.join(args.out, "profiles", config.label))


def profiler_config(args, config: ServerConfig) -> str:
    return json.dumps({"profiler": "torch", "torch_profiler_dir": profile_dir(args, config),
                       "torch_profiler_with_stack": False, "max_iterations": PROFILED_STEPS})  # fmt: skip


def row_from_result(config, args, io, concurrency, raw_path, result: dict, generator: str) -> dict:
    shape = SHAPES[args.model_shape]
    nblocks = adapter_nblocks(args, config)
    return {
        "mode": config.mode, "tp": config.tp, "rank": config.rank,
        "trainable_params": trainable_params(shape, config.rank, nblocks) if config.rank else 0,
        "input_len": io[0], "output_len": io[1], "concurrency": concurrency, "num_adapters": config.num_adapters,
        **normalise(generator, result),
        "model_shape": args.model_shape, "load_generator": LABELS[generator],
        "raw_file": os.path.relpath(raw_path, args.out),
    }  # fmt: skip


def profile_once(args, config, model, adapters, url, io, concurrency) -> None:
    """One wave of `concurrency` requests under vLLM's profiler, unless this server's profile exists."""
    folder = profile_dir(args, config)
    name = f"io{io[0]}-{io[1]}_bs{concurrency}"
    if os.path.exists(os.path.join(folder, f"bench_{name}.json")):
        return
    os.makedirs(folder, exist_ok=True)
    rc, _ = run_point(args, model, adapters, url, io, concurrency, os.path.join(folder, f"bench_{name}.json"),
                      os.path.join(folder, f"bench_{name}.log"), profile=True, generator="vllm")  # fmt: skip
    # vLLM 0.26 names them profiler_out_<rank>.txt, 0.32 rank<rank>.profiler_out.txt
    tables = sorted(glob.glob(os.path.join(folder, "*profiler_out*.txt")))
    print(f"[sweep] profiled {config.label} io={io[0]}/{io[1]} bs={concurrency}: rc={rc}, "
          f"{len(tables)} rank table(s) in {folder}", flush=True)  # fmt: skip


def measure_point(args, config, model, adapters, url, io, concurrency, generator, finished, writer, csv_file,
                  failures, progress) -> int:  # fmt: skip
    """One point with one load generator against the running server: its row in points.csv (1), or a failure or a
    point already measured (0)."""
    name = point_name(config, io, concurrency, generator)
    if name in finished:
        return 0
    bench_log = os.path.join(args.out, "logs", name.replace(".json", ".log"))
    raw = os.path.join(args.out, "raw", name)
    rc, result = run_point(args, model, adapters, url, io, concurrency, raw, bench_log, generator=generator)
    if result is None:
        failures.append(f"{name}: {LABELS[generator]} rc={rc}, see {bench_log}")
        print(f"[sweep] FAILED {name}\n{tail(bench_log, 8)}", flush=True)
        return 0
    row = row_from_result(config, args, io, concurrency, raw, result, generator)
    writer.writerow(row)
    csv_file.flush()
    done, total, started = progress
    eta = (time.monotonic() - started) / done * (total - done)
    print(f"[sweep] {done}/{total} {config.label} io={io[0]}/{io[1]} bs={concurrency} ({LABELS[generator]}): "
          f"tpot {row['median_tpot_ms']:.2f} ms, ttft {row['median_ttft_ms']:.1f} ms, "
          f"{row['output_throughput']:.1f} tok/s (eta {eta / 60:.0f} min)", flush=True)  # fmt: skip
    return 1


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = plan(args)
    ios = [tuple(int(x) for x in pair.split("/")) for pair in args.io.split(",")]
    concurrencies = csv_ints(args.concurrency)
    profiled = csv_ints(args.profile_concurrency)
    total = len(configs) * len(ios) * len(concurrencies) * len(args.load_generators)
    print(f"[sweep] {len(configs)} server configurations, {total} points -> {args.out}", flush=True)
    if args.dry_run:
        for config in configs:
            placeholders = {f"a{i}": "ADAPTER" for i in range(config.num_adapters)}
            print(" ", config.label, "$", " ".join(serve_command(args, config, "MODEL", placeholders, 0)))
        return 0
    for sub in ("raw", "logs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    record_environment(args.out, "bench.sweep", sys.argv[1:] if argv is None else argv)
    model = make_dummy_model(args.model_shape, os.path.join(args.workdir, args.model_shape))
    csv_path = os.path.join(args.out, "points.csv")
    finished = points_so_far(csv_path)  # a rerun resumes after them
    failures, done, measured, started = [], 0, 0, time.monotonic()
    with open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if f.tell() == 0:  # a new (or empty) file; one with a header but no points yet keeps its header
            writer.writeheader()
        for config in configs:
            names = [point_name(config, io, bs, g) for io in ios for bs in concurrencies for g in args.load_generators]
            if all(name in finished for name in names):
                done += len(names)
                continue
            if args.stop_after_minutes and time.monotonic() - started > 60 * args.stop_after_minutes:
                print(f"[sweep] time budget spent; rerun the same command to resume at {config.label}")
                break
            adapters = adapter_paths(args, config)
            done_after_config = done + len(names)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = os.path.join(args.out, "logs", f"server_{config.label}.log")
            command = serve_command(args, config, model, adapters, port)
            print(f"[sweep] starting {config.label}: {' '.join(command)}", flush=True)
            proc = launch(command, log_path, config.tp)
            try:
                wait_healthy(proc, url, log_path, args.start_timeout)
                for io in ios:
                    for concurrency in concurrencies:
                        for generator in args.load_generators:
                            done += 1
                            point = (io, concurrency, generator)
                            measured += measure_point(args, config, model, adapters, url, *point, finished, writer, f,
                                                      failures, (done, total, started))  # fmt: skip
                for io in ios:
                    for concurrency in profiled:
                        profile_once(args, config, model, adapters, url, io, concurrency)
            except (RuntimeError, TimeoutError) as e:
                failures.append(f"{config.label}: server did not start: {str(e).splitlines()[0]}")
                print(f"[sweep] server {config.label} failed:\n{e}", flush=True)
                done = done_after_config  # progress counts this configuration's points as attempted
            finally:
                stop_server(proc)
                wait_gpu_memory_released()
    with open(os.path.join(args.out, "failures.txt"), "w") as f:
        f.write("\n".join(failures) + ("\n" if failures else ""))
    from bench.report import write_report

    write_report(args.out)
    print(f"[sweep] done: {measured} points measured this run, {len(failures)} failure(s); see {args.out}/summary.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

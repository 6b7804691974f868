"""Shared timing harness for kernel benchmarks: median of CUDA-event-timed trials after warm-up, the
host's measured copy bandwidth, and results stamped with GPU, versions and the exact command."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch


def time_cuda(fn, trials: int = 200, warmup: int = 10, graph_repeats: int = 0) -> dict:
    """Median/p10/p90 milliseconds of `fn()` over `trials` CUDA-event-timed calls after `warmup` calls.

    graph_repeats > 0 captures that many back-to-back calls in one CUDA graph and reports a replay's time
    divided by it: the kernels' own time, without Python and launch overhead (serving replays graphs too).
    """
    if graph_repeats:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_repeats):
                fn()
        fn = graph.replay
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / max(graph_repeats, 1))
    times.sort()
    n = len(times)
    return {"median_ms": statistics.median(times), "p10_ms": times[n // 10], "p90_ms": times[9 * n // 10]}


def copy_bandwidth_gbs(mib: int = 1024) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), the ceiling for streaming kernels."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), trials=50)["median_ms"]
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command_line(),
    }


def command_line() -> str:
    """How this benchmark was started, as `python3 -m package.module args` when run as a module."""
    script, args = sys.argv[0], sys.argv[1:]
    rel = os.path.relpath(script)
    if rel.endswith(".py") and not rel.startswith(".."):
        return " ".join([os.path.basename(sys.executable), "-m", rel[:-3].replace(os.sep, "."), *args])
    return " ".join([os.path.basename(sys.executable), script, *args])


def kernel_bench_cli(parser, argv, report, name: str, kind=None):
    """The steps every kernel benchmark's CLI shares: `--report JSON` only rewrites `<name>.md` (returns None);
    otherwise `--out` is required, a CUDA GPU too, and the host's copy bandwidth is measured first. `kind`: for
    a benchmark whose flags make it time something else, a function of the parsed arguments returning that
    run's (report, name) instead. Returns (arguments, copy bandwidth in GB/s, report, name)."""
    parser.add_argument("--out", help=f"results folder ({name}.json/.csv/.md)")
    parser.add_argument("--report", metavar="JSON", help=f"only (re)write {name}.md from a results JSON")
    args = parser.parse_args(argv)
    if kind is not None:
        report, name = kind(args)
    if args.report:
        print(report(args.report))
        return None
    if not args.out:
        parser.error("--out is required")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (kernel timings are CUDA-event timings)")
    return args, copy_bandwidth_gbs(), report, name


def write_results(out_dir: str, name: str, rows: list[dict], extra: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"environment": environment(), **extra, "rows": rows}, f, indent=1)
    if rows:
        import csv

        with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def report_start(json_path: str, title) -> tuple[dict, list[dict], list[str]]:
    """A kernel report's results, rows and opening lines: title (a string, or made from the rows), GPU and
    versions (with the copy bandwidth the run measured), the exact command."""
    with open(json_path) as f:
        results = json.load(f)
    if callable(title):
        title = title(results["rows"])
    env = results["environment"]
    bandwidth = (
        f"; measured copy bandwidth {results['copy_bandwidth_gbs']} GB/s" if "copy_bandwidth_gbs" in results else ""
    )
    lines = [
        f"# {title}",
        "",
        f"- GPU `{env['gpu']}`, torch `{env['torch']}`, triton `{env['triton']}`, {env['time']}{bandwidth}",
        f"- command: `{env['command']}`",
    ]
    return results, results["rows"], lines


def write_report(json_path: str, name: str, lines: list[str]) -> str:
    """`<name>.md` beside the results JSON; returns its path."""
    out = os.path.join(os.path.dirname(json_path), f"{name}.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def finish(out_dir: str, name: str, rows: list[dict], copy_gbs: float, report) -> int:
    """Write the results (JSON, CSV) with the copy bandwidth, then their report; print its path."""
    print(report(write_results(out_dir, name, rows, {"copy_bandwidth_gbs": round(copy_gbs, 1)})))
    return 0


def add_write_table_arguments(parser, search_flag: str, what: str) -> None:
    """--write-table [JSON] and --min-gain, for a benchmark whose `search_flag` times candidate launches: `what` it
    writes into the GPU's plan table."""
    parser.add_argument("--write-table", nargs="?", const="", metavar="JSON",
                        help=f"with {search_flag}: write {what} into this GPU's plan table (default: "
                             "vllm_bdlora/kernels/configs/<this GPU>.json) where it beats the table's launch by more "
                             "than --min-gain")  # fmt: skip
    parser.add_argument("--min-gain", type=float, default=0.02,
                        help="the fraction of the table's time a candidate must save to replace it "
                             "(default 0.02)")  # fmt: skip


def relative_times(timed: dict, current) -> dict:
    """candidate -> {point: its time over the current launch's}, for candidates timed at every point (an adapter
    count, a token count): what the plan searches rank candidates by."""
    base = timed[current]
    return {c: {a: ms / base[a] for a, ms in times.items()} for c, times in timed.items()
            if all(ms is not None for ms in times.values())}  # fmt: skip


# A search times each candidate once, and the fastest of many single timings is partly the fastest noise: on an
# H100 a prefill pair a sweep found 11% faster than the table's launches took the same time in a run of its own. So
# a search times the current launch and its CONFIRM_TOP best candidates again, CONFIRM_ROUNDS rounds in alternating
# order, and chooses on those times alone.
CONFIRM_TOP = 8
CONFIRM_ROUNDS = 3


def finalists(ranked: list, current) -> list:
    """What `confirm` times: the current launch (None where it was not timed) and the CONFIRM_TOP first others of
    `ranked` (the candidates, fastest in the sweep first)."""
    return ([current] if current is not None else []) + [c for c in ranked if c != current][:CONFIRM_TOP]


def confirm(candidates: list, time_at, points: list, rounds: int = CONFIRM_ROUNDS) -> dict:
    """`candidates` (hashable; the current launch among them) timed again: `time_at(candidate, point)` ms for every
    candidate at every point once a round, every other round in reverse order, so that drift and position weigh on
    all of them alike. Returns candidate -> {point: [ms of each round]}."""
    times = {c: {p: [] for p in points} for c in candidates}
    for round_index in range(rounds):
        for c in candidates if round_index % 2 == 0 else candidates[::-1]:
            for p in points:
                times[c][p].append(round(time_at(c, p), 5))
    return times


def medians(confirmed: dict) -> dict:
    """`confirm`'s rounds as `choose` takes them: candidate -> {point: the median of its rounds}."""
    return {c: {p: round(statistics.median(t), 5) for p, t in by_point.items()} for c, by_point in confirmed.items()}


def choose(timed: dict, current, min_gain: float):
    """The candidate of lowest mean relative time among those no point of which is slower than the current launch
    by more than `min_gain` (the current launch where none saves more than `min_gain` on the mean). `timed`:
    candidate -> {point: ms, None where not timed}, the current launch's entry included."""
    relative = relative_times(timed, current)
    allowed = {c: statistics.mean(r.values()) for c, r in relative.items() if max(r.values()) <= 1 + min_gain}
    best = min(allowed, key=allowed.get)
    return best if allowed[best] < 1 - min_gain else current


def update_plan_table(path: str | None, update) -> None:
    """Read the plan table at `path` (by default this GPU's in vllm_bdlora/kernels/configs; a new, empty one where
    none exists), let `update(table)` change it and return a line per key it looked at, print those, write it back."""
    from vllm_bdlora.kernels.plans import PlanTable, table_path

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    path = path or table_path(props.name)
    if os.path.exists(path):
        with open(path) as f:
            table = PlanTable.from_json(f.read(), source=path)
    else:
        table = PlanTable.empty(props.name, props.multi_processor_count)
    for line in update(table):
        print(line)
    with open(path, "w") as f:
        f.write(table.to_json())
    print(f"plan table: {path}")

"""The many-adapter benchmark's report (`bench/many_adapters.py`): `summary.md` from `summary.json`, `servers.json` and
`environment.json`, and `plots/` from `requests.csv`: a TTFT CDF per workload (one line per mode) and throughput
against the number of adapters where runs of several N share a folder.

    python -m bench.many_report bench/results/many-adapters/tp4-llama3.1-8b-h200
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections import defaultdict

from bench.plots import write_figure

MODE_COLORS = {"base": "black", "bdlora": "tab:blue", "nfs": "tab:orange", "slora": "tab:green"}


def fmt(value, digits: int = 0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def load_figures(row: dict) -> str:
    kinds = [k.removeprefix("loads_") for k in row if k.startswith("loads_")]
    return ", ".join(f"{k} {int(row['loads_' + k])} ({fmt(row.get(f'load_{k}_mean_ms'), 1)} ms mean, "
                     f"{fmt(row.get(f'load_{k}_p99_ms'), 0)} p99)" for k in sorted(kinds)) or "-"  # fmt: skip


def slot_hits(row: dict) -> str:
    """GPU-slot hit rate and the slot fills it leaves (a lookup per engine step and adapter), then the fills steps made
    themselves by why none was made ahead (`vllm_bdlora.metrics.IN_STEP_CAUSES`), and the requests that sat out a
    step while their adapter was filled beside it instead (`vllm_bdlora.scheduling.hold_for_fills`)."""
    from vllm_bdlora.metrics import IN_STEP_CAUSES

    if "gpu_hit_rate" not in row:
        return "-"
    counts = {cause: int(row.get(f"in_step_{cause}") or 0) for cause in IN_STEP_CAUSES}
    causes = ", ".join(f"{cause} {count}" for cause, count in counts.items() if count)
    in_step = f"; in a step: {causes}" if causes else ""
    held = f"; requests held a step for a fill: {int(row['held_slot_fill'])}" if row.get("held_slot_fill") else ""
    return f"{fmt(100 * row['gpu_hit_rate'], 1, '%')} ({int(row['gpu_misses'])} fills{in_step}{held})"


def admission_stage_lines(servers: list[dict]) -> list[str]:
    """Where one admission's time went on the first worker's admission threads, stage by stage: wall and thread CPU
    (`vllm_bdlora.metrics.StageClock`; wall minus CPU is waiting, for the interpreter lock above all)."""
    from vllm_bdlora.metrics import ADMISSION_STAGES

    timed = [s for s in servers if any(k.startswith("admission_") for k in s.get("load_figures") or {})]
    if not timed:
        return []
    lines = ["", "## One admission's stages (ms per adapter, wall / thread CPU, first worker)", "",
             "| mode | " + " | ".join(ADMISSION_STAGES) + " | all |",
             "|---|" + "---|" * (len(ADMISSION_STAGES) + 1)]  # fmt: skip

    def ms(figures, stages, clock):
        return sum(figures.get(f"admission_{stage}_{clock}_ms", 0.0) for stage in stages)

    for s in timed:
        figures = s["load_figures"]
        cells = [f"{fmt(ms(figures, stages, 'wall'), 1)} / {fmt(ms(figures, stages, 'cpu'), 1)}"
                 for stages in (*((stage,) for stage in ADMISSION_STAGES), ADMISSION_STAGES)]  # fmt: skip
        lines.append(f"| {s['mode']} | " + " | ".join(cells) + " |")
    return lines


def summary_lines(rows: list[dict], servers: list[dict], environment: dict) -> list[str]:
    lines = ["# Many adapters", ""]
    runs = environment.get("runs") or []
    if runs:
        lines += [f"`{runs[-1]['command']}` ({runs[-1]['started']})", ""]
    lines += [f"Host: {', '.join(environment.get('gpus', []))}; vLLM {environment.get('vllm')}, torch "
              f"{environment.get('torch')}, vllm-bdlora {environment.get('vllm_bdlora')}.", ""]  # fmt: skip
    lines += ["## Servers (equal memory)", "",
              "| mode | --max-lora-rank | slot per GPU | --max-loras | host per adapter per worker | host entries | "
              "start | load all adapters | its loads (first worker; add_lora: the engine loop's wait) |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in servers:
        if s["mode"] == "base":
            lines.append(f"| base | - | - | - | - | - | {fmt(s.get('start_s'), 0, ' s')} | - | - |")
            continue
        lines.append(
            f"| {s['mode']} | {s['max_lora_rank']} | {fmt(s['slot_bytes'] / 2**20, 1, ' MiB')} | {s['max_loras']} | "
            f"{fmt(s['host_bytes_per_adapter'] / 2**20, 1, ' MiB')} | {s['host_entries']} | "
            f"{fmt(s.get('start_s'), 0, ' s')} | {fmt(s.get('load_all_s'), 0, ' s')} | "
            f"{load_figures(s.get('load_figures') or {})} |" + (f" failed: {s['failure']}" if "failure" in s else "")
        )
    lines += admission_stage_lines(servers)
    by_workload = defaultdict(list)
    for row in rows:
        by_workload[row["workload"]].append(row)
    for members in by_workload.values():
        first = members[0]
        heading = f"## {first['popularity']}, {first['arrivals']}, {first['lengths']}, {first['requests']} requests"
        lines += ["", heading,
                  "", "| mode | N | ok | out tok/s | req/s | goodput (TTFT ≤ "
                  f"{first['ttft_slo_s']} s)/s | TTFT p50 / p99 ms | head p99 | tail p99 | TPOT p50 / p99 ms | "
                  "GPU-slot hits | host hits | step p50 / p99 ms | loads |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in members:
            lines.append(
                f"| {r['mode']} | {r['adapters']} | {r['completed']}/{r['requests']} | "
                f"{fmt(r['output_tokens_per_s'])} | {fmt(r['requests_per_s'], 2)} | {fmt(r['goodput_per_s'], 2)} | "
                f"{fmt(r['all_ttft_p50_ms'])} / {fmt(r['all_ttft_p99_ms'])} | {fmt(r['head_ttft_p99_ms'])} | "
                f"{fmt(r['tail_ttft_p99_ms'])} | {fmt(r['all_tpot_p50_ms'], 2)} / {fmt(r['all_tpot_p99_ms'], 2)} | "
                f"{slot_hits(r)} | "
                f"{fmt(100 * r['cpu_hit_rate'], 1, '%') if 'cpu_hit_rate' in r else '-'} | "
                f"{fmt(r.get('step_p50_ms'), 1)} / {fmt(r.get('step_p99_ms'), 1)} | {load_figures(r)} |"
            )
    return lines


def read_requests(results_dir: str) -> list[dict]:
    path = os.path.join(results_dir, "requests.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_plots(results_dir: str, rows: list[dict], requests: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.join(results_dir, "plots"), exist_ok=True)
    written = []
    ttfts = defaultdict(lambda: defaultdict(list))
    for r in requests:
        if r["status"] == "200" and r["ttft"] not in ("", "nan"):
            ttfts[r["workload"]][r["mode"]].append(float(r["ttft"]) * 1e3)
    for workload, by_mode in ttfts.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, values in sorted(by_mode.items()):
            values.sort()
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=mode,
                    color=MODE_COLORS.get(mode))  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(workload.replace("_", " "), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(write_figure(fig, os.path.join(results_dir, "plots", f"ttft_cdf_{workload}.png")))
    by_popularity = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_popularity[f"{row['popularity']} {row['arrivals']}"][row["mode"]].append(
            (row["adapters"], row["output_tokens_per_s"])
        )
    for key, by_mode in by_popularity.items():
        if max(len({n for n, _ in points}) for points in by_mode.values()) < 2:
            continue  # one N: nothing to draw against
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, points in sorted(by_mode.items()):
            ax.plot(*zip(*sorted(points), strict=True), marker="o", label=mode, color=MODE_COLORS.get(mode))
        ax.set_xscale("log")
        ax.set_xlabel("adapters (N)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(key)
        ax.legend()
        name = f"throughput_vs_n_{key.replace(' ', '_').replace(':', '')}.png"
        written.append(write_figure(fig, os.path.join(results_dir, "plots", name)))
    return written


def write_report(results_dir: str) -> str:
    def load(name, default):
        path = os.path.join(results_dir, name)
        if not os.path.exists(path):
            return default
        with open(path) as f:
            return json.load(f)

    rows, servers, environment = load("summary.json", []), load("servers.json", []), load("environment.json", {})
    lines = summary_lines(rows, servers, environment)
    try:
        plots = write_plots(results_dir, rows, read_requests(results_dir))
    except ImportError:  # a host without matplotlib: `python -m bench.many_report DIR` draws them later
        plots = []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}](plots/{os.path.basename(p)})" for p in plots]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    print(write_report(sys.argv[1]))

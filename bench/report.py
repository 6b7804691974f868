"""Summary and plots of a sweep's `points.csv`:  python -m bench.report RESULTS_DIR

summary.md: host, versions and the exact command; per setting a table of every mode and rank (with the first
wave's prefill time where the raw files keep per-request timings); BD-LoRA's
speed-ups over NFS-LoRA and S-LoRA at the paper's paired ranks and its cost over the base model (on vLLM's
LoRA kernels and on the fused kernels, whichever ran); where TP=4 was measured, the TP=4 serving targets, each
marked met / missed / not measured.
plots/: TPOT, TTFT and throughput against trainable parameters, one line per mode, one panel per
concurrency (the layout of the BD-LoRA paper's Figure 5).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import defaultdict

from bench.adapters import PAPER_RANK_PAIRS, bd_rank_for
from bench.plots import write_figure
from bench.run_record import pop_runs, recorded_option

METRICS = (("median_tpot_ms", "TPOT (ms)"), ("median_ttft_ms", "TTFT (ms)"), ("output_throughput", "tokens/s"))
MODE_STYLE = {
    "base": ("black", "--"),
    "nfs": ("tab:blue", "-"),
    "slora": ("tab:orange", "-"),
    "bdlora": ("tab:green", "-"),
    "bddora": ("tab:purple", ":"),
    "bdfused": ("tab:olive", "-."),
}


def read_points(results_dir: str) -> list[dict]:
    with open(os.path.join(results_dir, "points.csv")) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key, value in row.items():
            if key in ("mode", "model_shape", "load_generator", "raw_file"):
                continue
            row[key] = float(value) if value not in ("", None) else None
    return rows


def setting(row) -> tuple:
    return int(row["tp"]), int(row["input_len"]), int(row["output_len"]), int(row["num_adapters"] or 1)


def generator_label(row) -> str:
    from bench.load_generators import LABELS

    generator = row.get("load_generator") or "vllm"
    return LABELS.get(generator, generator)


def primary_generator(rows) -> str:
    """The load generator the tables, speed-ups and plots are made from: `vllm bench serve` where it ran, else the
    one that did. Points a second generator measured against the same servers get tables of their own."""
    from bench.load_generators import LABELS

    labels = [generator_label(r) for r in rows]
    return LABELS["vllm"] if LABELS["vllm"] in labels or not labels else labels[0]


def index(rows) -> dict:
    """(tp, in, out, adapters, concurrency) -> {(mode, rank): row} over the primary generator's points; base rows
    serve every adapter count."""
    primary = primary_generator(rows)
    rows = [r for r in rows if generator_label(r) == primary]
    table = defaultdict(dict)
    adapter_counts = {int(r["num_adapters"]) for r in rows if r["mode"] != "base"} or {1}
    for row in rows:
        counts = adapter_counts if row["mode"] == "base" else {int(row["num_adapters"])}
        for n in counts:
            tp, i, o, _ = setting(row)
            table[(tp, i, o, n, int(row["concurrency"]))][(row["mode"], int(row["rank"]))] = row
    return table


BD_SERVING = {"bdlora": "vLLM's LoRA kernels", "bdfused": "vllm-bdlora's fused kernels"}


def bd_comparisons(points: dict):
    """(BD mode, standard rank r, BD rank r', BD's row, {"nfs"/"slora": the row at rank r or None}) for every BD
    point of one setting ({(mode, rank): row}), in BD_SERVING then PAPER_RANK_PAIRS order."""
    for bd_mode in BD_SERVING:
        for r, r_bd in PAPER_RANK_PAIRS.items():
            bd = points.get((bd_mode, r_bd))
            if bd:
                yield bd_mode, r, r_bd, bd, {mode: points.get((mode, r)) for mode in ("nfs", "slora")}


def speedups(points: dict) -> list[str]:
    """Each way of serving BD adapters against the baselines of paired rank and the base model, then
    the fused kernels against vLLM's where both ran."""
    lines = []
    base = points.get(("base", 0))
    for bd_mode, r, r_bd, bd, baselines in bd_comparisons(points):
        kernels = " on the fused kernels" if bd_mode == "bdfused" else ""
        parts = []
        for mode, other in baselines.items():
            if other:
                parts.append(
                    f"vs {mode} r={r} ({other['trainable_params'] / 1e6:.3g}M): TPOT "
                    f"{speed(bd['median_tpot_ms'], other['median_tpot_ms'])}, throughput ×"
                    f"{bd['output_throughput'] / other['output_throughput']:.2f}"
                )
        if base:
            parts.append(f"TPOT {bd['median_tpot_ms'] / base['median_tpot_ms']:.3f}× base")
        dora = points.get(("bddora", r_bd)) if bd_mode == "bdlora" else None
        if dora:
            parts.append(f"BD-DoRA TPOT {dora['median_tpot_ms'] / bd['median_tpot_ms']:.3f}× BD-LoRA")
        if parts:
            lines.append("; ".join([f"BD r'={r_bd}{kernels} ({bd['trainable_params'] / 1e6:.3g}M params)", *parts]))
    for (mode, r_bd), fused in sorted(points.items()):
        bd = points.get(("bdlora", r_bd))
        if mode == "bdfused" and bd:
            lines.append(
                f"BD r'={r_bd} on the fused kernels: TPOT {speed(fused['median_tpot_ms'], bd['median_tpot_ms'])}, "
                f"TTFT {speed(fused['median_ttft_ms'], bd['median_ttft_ms'])}, throughput ×"
                f"{fused['output_throughput'] / bd['output_throughput']:.2f} vs BD-LoRA on vLLM's kernels"
            )
    return lines


def speed(ours_ms: float, theirs_ms: float) -> str:
    """'1.17× faster' or '1.32× slower': a time ratio a reader need not invert."""
    return f"{theirs_ms / ours_ms:.2f}× faster" if ours_ms <= theirs_ms else f"{ours_ms / theirs_ms:.2f}× slower"


def measured(ranks, candidates) -> str:
    """Which standard ranks a verdict rests on, when not all of `candidates` were measured."""
    missing = sorted(set(candidates) - set(ranks))
    if not ranks or not missing:
        return ""
    return f" (measured at r={', '.join(map(str, ranks))}; not at r={', '.join(map(str, missing))})"


NFS_TARGET_RANKS = [r for r in PAPER_RANK_PAIRS if r >= 64]  # "no slower than NFS-LoRA at any rank ≥ 64"


def bd_checks(table: dict, bd_mode: str) -> dict:
    """The four BD-LoRA targets for one way of serving BD adapters (`bdlora` or `bdfused`): each True, False
    or None (not measured), with the standard ranks the NFS and throughput verdicts rest on."""
    p1 = table.get((4, 1024, 128, 1, 1), {})
    base, bd128, slora64 = p1.get(("base", 0)), p1.get((bd_mode, 128)), p1.get(("slora", 64))
    nfs_ranks = [r for r in NFS_TARGET_RANKS if (bd_mode, bd_rank_for(r)) in p1 and ("nfs", r) in p1]
    nfs_checks = [
        p1[(bd_mode, bd_rank_for(r))]["median_tpot_ms"] <= p1[("nfs", r)]["median_tpot_ms"] for r in nfs_ranks
    ]
    tput_pairs = [
        (points, r, r_bd, mode)
        for key, points in table.items()
        if key[0] == 4 and key[4] == 64
        for r, r_bd in PAPER_RANK_PAIRS.items()
        for mode in ("nfs", "slora")
        if (bd_mode, r_bd) in points and (mode, r) in points
    ]
    tput_checks = [
        p[(bd_mode, rb)]["output_throughput"] >= p[(m, r)]["output_throughput"] for p, r, rb, m in tput_pairs
    ]
    return {
        "base": bd128["median_tpot_ms"] <= 1.05 * base["median_tpot_ms"] if base and bd128 else None,
        "slora": slora64["median_tpot_ms"] >= 1.3 * bd128["median_tpot_ms"] if slora64 and bd128 else None,
        "nfs": all(nfs_checks) if nfs_checks else None,
        "nfs_ranks": nfs_ranks,
        "throughput": all(tput_checks) if tput_checks else None,
        "throughput_ranks": sorted({r for _, r, _, _ in tput_pairs}),
    }


def targets(table: dict) -> list[str]:
    """The TP=4 serving targets, on the 1024/128 single-adapter setting (throughput: every setting), judged
    for BD-LoRA on vLLM's kernels (`bdlora`), then again on the fused kernels where `bdfused` was run."""

    def verdict(ok):
        return "not measured" if ok is None else ("met" if ok else "MISSED")

    def bd_lines(bd_mode: str, label: str) -> list[str]:
        c = bd_checks(table, bd_mode)
        return [
            f"- TP=4, BS=1, 1024/128: BD r'=128{label} TPOT ≤ 1.05× base — {verdict(c['base'])}",
            f"- TP=4, BS=1, 1024/128: BD r'=128{label} TPOT ≥ 1.3× faster than S-LoRA r=64 — {verdict(c['slora'])}",
            f"- TP=4, BS=1, 1024/128: BD{label} no slower than NFS-LoRA at every rank ≥ 64 — {verdict(c['nfs'])}"
            f"{measured(c['nfs_ranks'], NFS_TARGET_RANKS)}",
            f"- TP=4, BS=64: BD{label} throughput ≥ both baselines at every parameter-matched rank — "
            f"{verdict(c['throughput'])}{measured(c['throughput_ranks'], PAPER_RANK_PAIRS)}",
        ]

    fused_run = any(mode == "bdfused" for key, points in table.items() if key[0] == 4 for mode, _ in points)
    p1 = table.get((4, 1024, 128, 1, 1), {})
    dora_checks = [
        p1[("bddora", r_bd)]["median_tpot_ms"] <= 1.10 * p1[("bdlora", r_bd)]["median_tpot_ms"]
        for r_bd in PAPER_RANK_PAIRS.values()
        if ("bddora", r_bd) in p1 and ("bdlora", r_bd) in p1
    ]
    lines = [
        *bd_lines("bdlora", f" ({BD_SERVING['bdlora']})" if fused_run else ""),
        f"- TP=4, BS=1, 1024/128: BD-DoRA TPOT within 10% of the same BD adapter without DoRA — "
        f"{verdict(all(dora_checks) if dora_checks else None)}",
    ]
    if fused_run:
        lines += bd_lines("bdfused", f" ({BD_SERVING['bdfused']})")
    return lines


def raw_result(results_dir: str, row: dict) -> dict:
    """The point's raw load-generator result file, or {} where the row names none or it is gone."""
    path = os.path.join(results_dir, row.get("raw_file") or "")
    if not row.get("raw_file") or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def first_wave_ms(results_dir: str, row: dict) -> float | None:
    """Milliseconds from the first request's start until each of the first `concurrency` requests to start has
    its first token, from the raw file's per-request timings (None where the file does not keep them).

    At high concurrency the server hands out first tokens in bunches (TP=2, BS=64, one H200 run: 32 of the first
    64 within 3 ms), so the median TTFT moves with where a bunch falls; the first wave's completion time is the
    prefill throughput the median was meant to show."""
    raw = raw_result(results_dir, row)
    starts, ttfts = raw.get("start_times"), raw.get("ttfts")
    if not starts or not ttfts or len(starts) != len(ttfts):
        return None
    wave = sorted(zip(starts, ttfts, strict=True))[: int(row["concurrency"])]
    return (max(start + ttft for start, ttft in wave) - wave[0][0]) * 1000


def median_itl_ms(results_dir: str, row: dict) -> float | None:
    """Median gap between consecutive tokens over all requests: the points' column, or for points written
    before it existed, the raw `vllm bench serve` file's own median (None where neither has one).

    Median TPOT is each request's decode time per token, so at high concurrency a request that decodes
    through other requests' prefills carries them in its TPOT; the median inter-token latency is the plain
    decode step, which moves far less from run to run (TP=2, BS=64: TPOT 10.5 vs 15.4 ms in two runs,
    ITL 6.48 vs 6.56)."""
    if row.get("median_itl_ms") is not None:
        return row["median_itl_ms"]
    return raw_result(results_dir, row).get("median_itl_ms")


def write_summary(results_dir: str, rows: list[dict], table: dict) -> str:
    env_path = os.path.join(results_dir, "environment.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    failures_path = os.path.join(results_dir, "failures.txt")
    failures = open(failures_path).read().strip() if os.path.exists(failures_path) else ""
    out = [f"# Serving sweep: {os.path.basename(os.path.abspath(results_dir))}", ""]
    runs = pop_runs(env)
    max_loras = recorded_option(runs, "--max-loras") or "the sweep's default"
    out += [f"- {k}: `{v}`" for k, v in env.items()]
    out += [f"- started {run['started']}: `{run['command']}`" for run in runs]
    from bench.load_generators import LABELS, PROMPTS

    labels = sorted({LABELS.get(g, g) for g in (r.get("load_generator") or "vllm" for r in rows)})
    sent = "; ".join(f"`{label}` ({PROMPTS.get(label, 'its own prompts')})" for label in labels)
    out += ["", f"{len(rows)} points; load generator {sent}; ignore-eos.", ""]
    if any(key[0] == 4 for key in table):
        out += ["## Targets at TP=4", "", *targets(table), ""]
    if failures:
        out += ["## Failed points", "", "```", failures, "```", ""]
    for key in sorted(table):
        tp, i, o, n, bs = key
        points = table[key]
        out += [f"## TP={tp}, {i}/{o} tokens, {n} adapter(s), concurrency {bs}", ""]
        if n > 1:
            out += [f"Requests go round-robin over the {n} adapters. A step runs at most `--max-loras` of them "
                    f"({max_loras}); where {n} is more, TTFT includes the wait for a GPU slot.", ""]  # fmt: skip
        out += ["| mode | rank | params (M) | TPOT ms | ITL ms | TTFT ms | p99 TTFT ms | first wave ms | E2E ms | "
                "tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for (mode, rank), row in sorted(points.items(), key=lambda kv: (list(MODE_STYLE).index(kv[0][0]), kv[0][1])):
            p99 = f"{row['p99_ttft_ms']:.0f}" if row.get("p99_ttft_ms") is not None else "-"
            wave, itl = first_wave_ms(results_dir, row), median_itl_ms(results_dir, row)
            out.append(
                f"| {mode} | {rank} | {row['trainable_params'] / 1e6:.3g} | {row['median_tpot_ms']:.2f} | "
                f"{'-' if itl is None else f'{itl:.2f}'} | "
                f"{row['median_ttft_ms']:.1f} | {p99} | {'-' if wave is None else f'{wave:.0f}'} | "
                f"{row['median_e2el_ms']:.0f} | {row['output_throughput']:.1f} |"
            )
        out += ["", *[f"- {line}" for line in speedups(points)], ""]
        out += other_generator_tables(rows, key, points)
    text = "\n".join(out) + "\n"
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(text)
    return text


def other_generator_tables(rows: list[dict], key: tuple, points: dict) -> list[str]:
    """For one section: the same servers' points as measured by each other load generator, beside the primary's
    TTFT and TPOT (each generator times from its own client, so their ratio, not each number, is comparable)."""
    tp, i, o, n, bs = key
    primary = primary_generator(rows)
    out = []
    for label in sorted({generator_label(r) for r in rows} - {primary}):
        theirs = [r for r in rows if generator_label(r) == label and (*setting(r)[:3], int(r["concurrency"])) ==
                  (tp, i, o, bs) and int(r["num_adapters"] or 1) in (n, 0)]  # fmt: skip
        if not theirs:
            continue
        out += [f"Measured by `{label}` against the same servers (its own prompts and clock):", "",
                f"| mode | rank | TPOT ms | TTFT ms | E2E ms | tokens/s | TPOT / {primary}'s | TTFT / {primary}'s |",
                "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in sorted(theirs, key=lambda r: (r["mode"], int(r["rank"]))):
            mine = points.get((row["mode"], int(row["rank"]))) or {}
            ratios = [f"{row[k] / mine[k]:.2f}" if mine.get(k) else "-" for k in ("median_tpot_ms", "median_ttft_ms")]
            out.append(f"| {row['mode']} | {int(row['rank'])} | {row['median_tpot_ms']:.2f} | "
                       f"{row['median_ttft_ms']:.1f} | {row['median_e2el_ms']:.0f} | {row['output_throughput']:.1f} | "
                       f"{ratios[0]} | {ratios[1]} |")  # fmt: skip
        out.append("")
    return out


def write_plots(results_dir: str, table: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(os.path.join(results_dir, "plots"), exist_ok=True)
    groups = defaultdict(dict)
    for (tp, i, o, n, bs), points in table.items():
        groups[(tp, i, o, n)][bs] = points
    written = []
    for (tp, i, o, n), by_bs in sorted(groups.items()):
        concurrencies = sorted(by_bs)
        fig, axes = plt.subplots(len(METRICS), len(concurrencies), figsize=(4 * len(concurrencies), 9), squeeze=False)
        for col, bs in enumerate(concurrencies):
            for row_i, (metric, label) in enumerate(METRICS):
                ax = axes[row_i][col]
                for mode, (color, style) in MODE_STYLE.items():
                    pts = sorted(
                        (r["trainable_params"] / 1e6, r[metric]) for (m, _), r in by_bs[bs].items() if m == mode
                    )
                    if not pts:
                        continue
                    if mode == "base":
                        ax.axhline(pts[0][1], color=color, linestyle=style, label="base (no LoRA)")
                    else:
                        ax.plot(*zip(*pts, strict=True), color=color, linestyle=style, marker="o", label=mode)
                ax.set_xscale("log")
                # Ticks at the measured parameter counts: a few ranks span too little of a log axis for
                # matplotlib's own ticks (it labels minor ticks in overlapping scientific notation).
                counts = sorted({r["trainable_params"] / 1e6 for (m, _), r in by_bs[bs].items() if m != "base"})
                ax.set_xticks(counts, [f"{c:.0f}" for c in counts])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel("trainable parameters (M)")
                ax.set_ylabel(label)
                if row_i == 0:
                    ax.set_title(f"concurrency {bs}")
        axes[0][0].legend()
        fig.suptitle(f"TP={tp}, {i}/{o} tokens, {n} adapter(s)")
        written.append(write_figure(fig, os.path.join(results_dir, "plots", f"tp{tp}_io{i}-{o}_adapters{n}.png")))
    return written


def write_report(results_dir: str) -> None:
    rows = read_points(results_dir)
    table = index(rows)
    write_summary(results_dir, rows, table)
    write_plots(results_dir, table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", help="a sweep's --out folder (with points.csv and environment.json)")
    results_dir = parser.parse_args(argv).results_dir
    if not os.path.exists(os.path.join(results_dir, "points.csv")):
        parser.error(f"{results_dir} has no points.csv: give the folder a sweep wrote (its --out)")
    write_report(results_dir)
    print(os.path.join(results_dir, "summary.md"))


if __name__ == "__main__":
    main()

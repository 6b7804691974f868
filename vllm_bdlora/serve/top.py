"""`vllm-bdlora top URL`: a terminal view of a BD-LoRA server's adapters an operator can leave open, read from its
`/metrics` (`vllm_bdlora.metrics`): per adapter where it is resident, requests and generated tokens per second over
the last interval, p50/p99 time to first token, and the server's slots, loads and refusals.

    vllm-bdlora top http://localhost:8000 --api-key KEY [--interval 5] [--once]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict


def read_metrics(url: str, api_key: str | None) -> dict:
    """{metric name: {frozenset of label items: value}} from one scrape."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = requests.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][frozenset(sample.labels.items())] = sample.value
    return samples


def by_label(samples: dict, name: str, label: str, **fixed) -> dict:
    out = {}
    for labels, value in samples.get(name, {}).items():
        labels = dict(labels)
        if all(labels.get(k) == v for k, v in fixed.items()):
            out[labels.get(label)] = value
    return out


def quantile(buckets: dict, q: float) -> float:
    """The q-quantile of a Prometheus histogram's cumulative buckets ({upper bound: count}), interpolated."""
    bounds = sorted(buckets, key=lambda b: math.inf if b == "+Inf" else float(b))
    total = buckets[bounds[-1]] if bounds else 0
    if not total:
        return math.nan
    rank, previous_bound, previous_count = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        upper = math.inf if bound == "+Inf" else float(bound)
        if count >= rank:
            if upper == math.inf:
                return previous_bound
            share = (rank - previous_count) / max(count - previous_count, 1e-12)
            return previous_bound + (upper - previous_bound) * share
        previous_bound, previous_count = upper, count
    return previous_bound


def adapter_rows(now: dict, before: dict | None, seconds: float) -> list[tuple]:
    requests_now = by_label(now, "vllm_bdlora:adapter_requests_total", "adapter_name")
    tokens_now = by_label(now, "vllm_bdlora:adapter_generation_tokens_total", "adapter_name")
    requests_then = by_label(before, "vllm_bdlora:adapter_requests_total", "adapter_name") if before else {}
    tokens_then = by_label(before, "vllm_bdlora:adapter_generation_tokens_total", "adapter_name") if before else {}
    gpu = by_label(now, "vllm:lora_adapter_loaded", "adapter_name", level="gpu")
    cpu = by_label(now, "vllm:lora_adapter_loaded", "adapter_name", level="cpu")
    rows = []
    for name in sorted(set(requests_now) | set(gpu) | set(cpu)):
        buckets = {
            dict(labels)["le"]: value
            for labels, value in now.get("vllm_bdlora:adapter_ttft_seconds_bucket", {}).items()
            if dict(labels).get("adapter_name") == name
        }
        where = "gpu" if gpu.get(name) else "host" if cpu.get(name) else "-"
        rate = (requests_now.get(name, 0) - requests_then.get(name, 0)) / seconds if before else math.nan
        tokens = (tokens_now.get(name, 0) - tokens_then.get(name, 0)) / seconds if before else math.nan
        rows.append((name, where, requests_now.get(name, 0), rate, tokens, quantile(buckets, 0.5),
                     quantile(buckets, 0.99)))  # fmt: skip
    return rows


def render(url: str, now: dict, before: dict | None, seconds: float) -> str:
    slots = by_label(now, "vllm_bdlora:lora_slots", "state")
    kept = by_label(now, "vllm_bdlora:adapters_kept", "where")
    loads = by_label(now, "vllm_bdlora:adapter_loads_total", "kind")
    refusals = by_label(now, "vllm_bdlora:adapter_refusals_total", "reason")
    lines = [
        f"{url}   slots {int(slots.get('used', 0))}/{int(slots.get('total', 0))}   kept in memory "
        f"{int(kept.get('memory', 0))}, spilled {int(kept.get('spilled', 0))}   loads "
        + (", ".join(f"{k} {int(v)}" for k, v in sorted(loads.items())) or "-")
        + "   refusals "
        + (", ".join(f"{k} {int(v)}" for k, v in sorted(refusals.items())) or "0"),
        "",
        f"{'adapter':<32} {'where':<5} {'requests':>9} {'req/s':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9}",
    ]
    footer = ("ttft p50/p99: since the server started, interpolated within its histogram's buckets (as PromQL's "
              "histogram_quantile): each lies in the bucket holding the true value, at most 1.5x wide")  # fmt: skip
    for name, where, total, rate, tokens, p50, p99 in adapter_rows(now, before, seconds):

        def number(x, fmt):
            return "-" if math.isnan(x) else format(x, fmt)

        lines.append(f"{name[:32]:<32} {where:<5} {int(total):>9} {number(rate, '.2f'):>7} {number(tokens, '.1f'):>8} "
                     f"{number(p50 * 1000, '.0f') + ' ms' if not math.isnan(p50) else '-':>9} "
                     f"{number(p99 * 1000, '.0f') + ' ms' if not math.isnan(p99) else '-':>9}")  # fmt: skip
    return "\n".join([*lines, "", footer])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-bdlora top", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("url", help="the server, e.g. http://localhost:8000")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="the server's --api-key")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    parser.add_argument("--once", action="store_true", help="print one view (two scrapes --interval apart) and exit")
    args = parser.parse_args(argv)
    before, then = None, time.monotonic()
    try:
        while True:
            try:
                now = read_metrics(args.url, args.api_key)
            except Exception as e:  # a server that restarts: say so and keep watching
                print(f"{args.url}: {e}", file=sys.stderr)
                if args.once:
                    return 1
                time.sleep(args.interval)
                continue
            seconds = max(time.monotonic() - then, 1e-6)
            if before is not None or not args.once:
                view = render(args.url, now, before, seconds)
                print(view if args.once else "\033[2J\033[H" + view, flush=True)
                if args.once:
                    return 0
            before, then = now, time.monotonic()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0

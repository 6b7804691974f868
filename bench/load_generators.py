"""Load generators the sweep can drive, normalised to one schema (the `points.csv` metric columns).

* `vllm` (default): `vllm bench serve`, shipped with vLLM. Random token prompts of exactly the requested
  length (the dummy model's tokenizer round-trips), warm-up requests, round-robin adapters.
* `llmperf`: Ray's LLMPerf (`token_benchmark_ray.py`), what the BD-LoRA paper used: Shakespeare-sonnet chat
  prompts. It cannot share an environment with vLLM (pydantic < 2.5), so it runs from its own checkout and
  interpreter (`--llmperf-dir`, `--llmperf-python`; bench/llmperf.py installs one), counting tokens with the
  served model's tokenizer (bench/llmperf_launch.py). It sends no warm-up requests of its own, so the sweep
  sends one wave first. Its inter-token latency divides by stream chunks, so its TPOT is comparable within an
  LLMPerf run, not across generators. Every request goes to one model: single-adapter points only.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from bench import llmperf

GENERATORS = ("vllm", "llmperf")
LABELS = {"vllm": "vllm bench serve", "llmperf": "llmperf token_benchmark_ray"}
# What each generator sends, for the summary.
PROMPTS = {
    "vllm bench serve": "random-token prompts of exactly the input length",
    "llmperf token_benchmark_ray": "LLMPerf's Shakespeare-sonnet chat prompts, tokens counted with the served "
    "model's tokenizer",
}


def num_prompts(prompts_per_concurrency: int, concurrency: int) -> int:
    return max(12, prompts_per_concurrency * concurrency)


def vllm_bench_command(url, model, adapters, io, concurrency, prompts, raw_dir, raw_name) -> list[str]:
    input_len, output_len = io
    command = ["vllm", "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", next(iter(adapters), model), "--tokenizer", model,
               "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--random-range-ratio", "0",
               "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--ignore-eos",
               "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--save-detailed", "--result-dir", raw_dir, "--result-filename", raw_name]  # fmt: skip
    if len(adapters) > 1:
        command += ["--lora-modules", *adapters, "--lora-assignment", "round-robin"]
    return command


def normalise(generator: str, raw: dict) -> dict:
    """The sweep's metric columns from a generator's own result JSON (milliseconds, tokens/s)."""
    if generator == "vllm":
        return {
            "median_tpot_ms": raw["median_tpot_ms"], "median_ttft_ms": raw["median_ttft_ms"],
            "median_e2el_ms": raw["median_e2el_ms"], "output_throughput": raw["output_throughput"],
            "p99_tpot_ms": raw.get("p99_tpot_ms"), "p99_ttft_ms": raw.get("p99_ttft_ms"),
            "median_itl_ms": raw.get("median_itl_ms"),
            "completed": raw.get("completed"), "num_prompts": raw.get("num_prompts"),
        }  # fmt: skip
    if generator == "llmperf":
        seconds = 1000.0
        return {
            "median_tpot_ms": raw["results_inter_token_latency_s_quantiles_p50"] * seconds,
            "median_ttft_ms": raw["results_ttft_s_quantiles_p50"] * seconds,
            "median_e2el_ms": raw["results_end_to_end_latency_s_quantiles_p50"] * seconds,
            "output_throughput": raw["results_mean_output_throughput_token_per_s"],
            "p99_tpot_ms": raw["results_inter_token_latency_s_quantiles_p99"] * seconds,
            "p99_ttft_ms": raw["results_ttft_s_quantiles_p99"] * seconds,
            # LLMPerf's "inter-token latency" is each request's decode time per token (what TPOT is above); it
            # keeps no per-gap latencies, so there is no median ITL to report
            "median_itl_ms": None,
            "completed": raw.get("results_num_completed_requests"),
            "num_prompts": raw.get("results_num_completed_requests"),
        }
    raise ValueError(f"unknown load generator {generator!r}; choose from {GENERATORS}")


def run_point(
    args, model, adapters, url, io, concurrency, raw_path, log_path, profile: bool = False, generator: str = ""
) -> tuple[int, dict | None]:
    """Run one load point with `generator` (default: args.load_generator); returns (exit code, the generator's
    result JSON, also saved at raw_path). With `profile`, one wave of requests (`concurrency` of them) with vLLM's
    profiler on (`vllm bench serve --profile`; the server needs --profiler-config)."""
    generator = generator or args.load_generator
    prompts = concurrency if profile else num_prompts(args.prompts_per_concurrency, concurrency)
    env = dict(os.environ)
    if generator == "vllm":
        raw_dir, raw_name = os.path.split(raw_path)
        command = vllm_bench_command(url, model, adapters, io, concurrency, prompts, raw_dir, raw_name)
        command += ["--profile"] if profile else []
    else:
        work = raw_path + ".llmperf"
        os.makedirs(work, exist_ok=True)
        env.update(OPENAI_API_BASE=f"{url}/v1", OPENAI_API_KEY="EMPTY")
        command = llmperf.command(args.llmperf_dir, args.llmperf_python, model, next(iter(adapters), model), io,
                                  concurrency, prompts, work)  # fmt: skip
    with open(log_path, "w") as out:
        if generator == "llmperf":
            out.write(warm_up(url, next(iter(adapters), model), io, concurrency) + "\n")
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        rc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=args.llmperf_dir if generator == "llmperf" else None).returncode  # fmt: skip
    if generator == "llmperf":
        summaries = glob.glob(os.path.join(raw_path + ".llmperf", "*_summary.json"))
        if summaries:
            shutil.copy(summaries[0], raw_path)
    if rc != 0 or not os.path.exists(raw_path):
        return rc, None
    with open(raw_path) as f:
        raw = json.load(f)
    if generator == "vllm":
        raw = keep_per_request_timings(raw)
        with open(raw_path, "w") as f:
            json.dump(raw, f)
    return rc, raw


def warm_up(url: str, model: str, io: tuple[int, int], concurrency: int) -> str:
    """One wave of `concurrency` (at least 2) chat requests of the point's shape, answered before the point is
    measured (what `vllm bench serve --num-warmups` does for the other generator): the first requests of a
    batch size pay one-off costs (kernel compiles, allocations) that would otherwise land in the point's p99."""
    import requests

    input_len, output_len = io
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(["warm"] * input_len)}],
            "max_tokens": output_len, "ignore_eos": True}  # fmt: skip

    def send(_):
        return requests.post(f"{url}/v1/chat/completions", json=body, timeout=600).status_code

    waves = max(2, concurrency)
    with ThreadPoolExecutor(waves) as pool:
        codes = list(pool.map(send, range(waves)))
    return f"warm-up: {waves} requests to {model}, HTTP {sorted(set(codes))}"


# Per-request fields of `vllm bench serve --save-detailed` too bulky to commit (one entry per token or the text).
BULKY_FIELDS = ("itls", "generated_texts")


def keep_per_request_timings(raw: dict) -> dict:
    """The raw result with each request's start time, TTFT and latency kept (a median TTFT that moves between
    runs can then be read request by request) and its inter-token latencies and text dropped."""
    return {key: value for key, value in raw.items() if key not in BULKY_FIELDS}

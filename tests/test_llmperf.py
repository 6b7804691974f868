"""The real LLMPerf (ray-project/llmperf, the BD-LoRA paper's load generator) measuring a BD-LoRA server on the
CPU through `bench.sweep --load-generator vllm,llmperf`, beside `vllm bench serve` against the same server.

LLMPerf runs from a checkout (BDLORA_LLMPERF_DIR, else ../shared/vendor/llmperf beside this repository) in an
interpreter of its own (BDLORA_LLMPERF_PYTHON, else .venv-llmperf, made here by bench/llmperf.py once)."""

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import llmperf

REPO = Path(__file__).resolve().parents[1]
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def llmperf_checkout() -> str:
    checkout = os.environ.get("BDLORA_LLMPERF_DIR") or str(REPO.parent / "shared" / "vendor" / "llmperf")
    if not os.path.exists(os.path.join(checkout, "token_benchmark_ray.py")):
        pytest.skip(f"no LLMPerf checkout at {checkout}: set BDLORA_LLMPERF_DIR to one")
    return checkout


@pytest.fixture(scope="module")
def llmperf_python() -> str:
    python = os.environ.get("BDLORA_LLMPERF_PYTHON")
    if python:
        return python
    venv = REPO / ".venv-llmperf"
    if not (venv / "bin" / "python").exists():
        llmperf.install(str(venv))
    return llmperf.venv_python(str(venv))


@pytest.mark.engine
def test_llmperf_and_vllm_bench_measure_one_bd_server_with_its_token_counts(llmperf_checkout, llmperf_python, tmp_path):
    from bench.sweep import main

    out = tmp_path / "results"
    argv = [
        "--model-shape", "tiny", "--tp", "1", "--modes", "bdlora", "--ranks", "8", "--io", f"64/{OUTPUT_TOKENS}",
        "--concurrency", "2", "--adapters", "1", "--prompts-per-concurrency", "3", "--max-model-len", "256",
        "--dtype", "float32", "--out", str(out), "--workdir", str(tmp_path / "work"), "--start-timeout", "240",
        "--load-generator", "vllm,llmperf", "--llmperf-dir", llmperf_checkout, "--llmperf-python", llmperf_python,
    ]  # fmt: skip
    assert main(argv) == 0, (out / "failures.txt").read_text()
    first, row = list(csv.DictReader(open(out / "points.csv")))
    assert first["load_generator"] == "vllm bench serve" and int(first["completed"]) == 12
    assert row["load_generator"] == "llmperf token_benchmark_ray" and row["mode"] == "bdlora"
    assert len(list((out / "logs").glob("server_*.log"))) == 1  # one server, measured by both
    assert int(row["completed"]) == 12  # max(12, 3 prompts x concurrency 2)
    assert float(row["median_ttft_ms"]) > 0 and float(row["output_throughput"]) > 0
    summary = json.loads((out / "raw" / Path(row["raw_file"]).name).read_text())
    # Every request asked for 16 tokens with ignore_eos; LLMPerf re-tokenizes each answer with the served
    # model's tokenizer and counts exactly what the server generated (a hub Llama tokenizer counts 3.4x).
    assert int(summary["results_number_output_tokens_min"]) == OUTPUT_TOKENS
    assert int(summary["results_number_output_tokens_max"]) == OUTPUT_TOKENS
    assert summary["results_number_errors"] == 0
    log = (out / "logs" / Path(row["raw_file"]).name.replace(".json", ".log")).read_text()
    assert log.startswith("warm-up: 2 requests to a0, HTTP [200]"), log[:500]
    text = (out / "summary.md").read_text()
    assert "Shakespeare-sonnet chat prompts" in text and "Measured by `llmperf token_benchmark_ray`" in text


def test_offline_install_takes_what_the_host_python_lacks_from_wheels_and_the_rest_from_it(llmperf_python, tmp_path):
    """An offline host (`install --wheels`): a venv made with no index sees the host interpreter's packages (here
    LLMPerf's own venv stands for a host's Python), so a wheels folder holding none of the requirements installs."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    python = llmperf.install(str(tmp_path / "venv"), python=llmperf_python, wheels=str(wheels))
    code = "import pydantic, ray, pandas, boto3; print(pydantic.VERSION, ray.__file__)"
    version, ray_file = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert version.startswith("2.4") and not ray_file.startswith(str(tmp_path))

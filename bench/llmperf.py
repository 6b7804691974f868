"""LLMPerf (ray-project/llmperf), the BD-LoRA paper's load generator, in a virtual environment of its own.

    git clone https://github.com/ray-project/llmperf          # or any copy of it, e.g. an air-gapped mirror
    python -m bench.llmperf install --checkout llmperf --venv .venv-llmperf   # offline: --wheels DIR
    python -m bench.sweep --load-generator llmperf --llmperf-dir llmperf \\
        --llmperf-python .venv-llmperf/bin/python --adapters 1 ...

LLMPerf cannot share vLLM's environment (it needs pydantic < 2.5), and `pip install -e llmperf` does not finish
on Python 3.11+ (its metadata asks for Python < 3.11, and its litellm requirement sends pip backtracking through
hundreds of releases). So LLMPerf itself is not installed: `install` puts only what its OpenAI-API benchmark
imports into a new venv, and the sweep runs `token_benchmark_ray.py` from the checkout through
bench/llmperf_launch.py, which adds the checkout's `src/` to the path and makes LLMPerf count tokens with the
served model's tokenizer (no model hub, counts equal the server's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# What token_benchmark_ray.py and LLMPerf's client modules import (boto3: its SageMaker client, imported by
# llmperf.common whatever API is chosen).
REQUIREMENTS = ("pydantic<2.5", "ray", "pandas", "requests", "transformers", "tqdm", "boto3")
# LLMPerf counts a response's tokens by re-tokenizing its text: special tokens (which a random model does
# generate) stay in the text so that the count is the server's.
SAMPLING = {"ignore_eos": True, "skip_special_tokens": False}
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llmperf_launch.py")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def install(venv: str, python: str = sys.executable, wheels: str | None = None) -> str:
    """Create `venv` with LLMPerf's requirements; returns its interpreter. `wheels`: an offline host's folder of
    wheels (`pip download`ed where an index is reachable) installed with no index; the venv then also sees the
    packages of `python` (its sys.path's site directories, appended after the venv's own, so the venv's versions
    win): only what that Python lacks or holds at another version, e.g. vLLM's pydantic, need be in the folder (on
    a GPU host with vLLM and Ray: pydantic < 2.5, pandas and boto3)."""
    subprocess.run([python, "-m", "venv", venv], check=True)
    offline = []
    if wheels:
        offline = ["--no-index", "--find-links", wheels]
        with open(os.path.join(site_packages(venv), "_host_packages.pth"), "w") as f:
            f.write("\n".join(site_directories(python)) + "\n")
    subprocess.run([venv_python(venv), "-m", "pip", "install", "-q", *offline, *REQUIREMENTS], check=True)
    return venv_python(venv)


SITE_DIRS = ("site-packages", "dist-packages")


def site_directories(python: str) -> list[str]:
    """The site-packages (or Debian dist-packages) folders on `python`'s sys.path, user site included: where a
    host's own packages are, whether its `python3` is a venv, a user install or the system's."""
    code = "import sys, os; print('\\n'.join(p for p in sys.path if os.path.basename(p) in {SITE_DIRS}))"
    return subprocess.run([python, "-c", code.format(SITE_DIRS=SITE_DIRS)], check=True, capture_output=True,
                          text=True).stdout.split()  # fmt: skip


def site_packages(venv: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([venv_python(venv), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def command(llmperf_dir, python, tokenizer, model_name, io, concurrency, prompts, results_dir) -> list[str]:
    """token_benchmark_ray.py for one point: `prompts` requests of exactly io = (input, output) tokens as
    counted by the served model's tokenizer (`tokenizer`, the model folder), `concurrency` at a time."""
    input_len, output_len = io
    return [python, LAUNCHER, "--llmperf-dir", llmperf_dir, "--tokenizer", tokenizer, "--",
            "--model", model_name,
            "--mean-input-tokens", str(input_len), "--stddev-input-tokens", "0",
            "--mean-output-tokens", str(output_len), "--stddev-output-tokens", "0",
            "--max-num-completed-requests", str(prompts), "--num-concurrent-requests", str(concurrency),
            "--timeout", "3600", "--results-dir", results_dir, "--llm-api", "openai",
            "--additional-sampling-params", json.dumps(SAMPLING | {"max_tokens": output_len})]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llmperf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="action", required=True)
    setup = sub.add_parser("install", help="create a venv that runs LLMPerf from a checkout")
    setup.add_argument("--checkout", required=True, help="LLMPerf's folder (with token_benchmark_ray.py)")
    setup.add_argument("--venv", default=".venv-llmperf")
    setup.add_argument("--wheels", help="offline: a folder of wheels to install from, with no package index")
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.checkout, "token_benchmark_ray.py")):
        parser.error(f"{args.checkout} has no token_benchmark_ray.py: give an LLMPerf checkout")
    python = install(args.venv, wheels=args.wheels)
    print(f"LLMPerf's interpreter: {python}\n"
          f"Use: python -m bench.sweep --load-generator llmperf --llmperf-dir {args.checkout} "
          f"--llmperf-python {python} --adapters 1 ...")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

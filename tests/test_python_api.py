"""The README's Python API script, run as written on the tests' tiny model and a BD-LoRA adapter (TP=2, CPU), with
none of the CPU backend's variables set: the plugin's defaults must let it start, and its answer equal PEFT's."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import readme_block_after
from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import greedy, load_reference
from vllm_bdlora.serve.cpu_defaults import KV_CACHE_SPACE, THREADS_BIND

pytestmark = pytest.mark.engine


def test_the_readme_python_script_runs_as_written_and_matches_peft(assets, tmp_path):
    script = readme_block_after("**The Python API.**", "python")
    demo = tmp_path / "demo"
    shutil.copytree(assets["model"], demo / "model")
    shutil.copytree(assets["bd64"], demo / "bd-r64")  # rank 64 in 2 blocks, as the demo's bd-r64
    (tmp_path / "serve.py").write_text(script.replace("/tmp/vllm-bdlora-demo", str(demo)))
    env = {k: v for k, v in os.environ.items() if k not in (KV_CACHE_SPACE, THREADS_BIND)}
    proc = subprocess.run([sys.executable, "serve.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    tokens, _ = greedy(load_reference(str(demo / "model"), str(demo / "bd-r64")), [10, 20, 30, 40], 8)
    answer = next(line for line in proc.stdout.splitlines() if line.startswith("answer:"))
    assert answer.split()[1:] == [tiny.word(t) for t in tokens], proc.stdout[-2000:]

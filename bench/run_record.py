"""A benchmark folder's `environment.json`: the host's versions, and every command that wrote into the folder (a
resumed or queued run adds its command rather than replacing the ones whose results are already there). Written by
the sweeps (`bench.sweep`, `bench.many_adapters`), read by their reports."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import time

FILE = "environment.json"


def environment() -> dict:
    import torch
    import vllm

    import vllm_bdlora

    gpu = (
        subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        .stdout.strip().splitlines()
        if shutil.which("nvidia-smi") else []
    )  # fmt: skip
    return {
        "host": platform.node(),
        "gpus": gpu or [f"CPU only ({os.cpu_count()} cores)"],
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "vllm_bdlora": vllm_bdlora.__version__,
        "python": platform.python_version(),
    }


def pop_runs(env: dict) -> list[dict]:
    """Removes and returns the commands (started, command) recorded in an environment.json: its `runs` list, or the
    single top-level pair that folders written before that list still hold."""
    legacy = {k: env.pop(k) for k in ("started", "command") if k in env}
    return env.pop("runs", None) or ([legacy] if legacy else [])


def record_environment(out_dir: str, program: str, argv: list[str]) -> None:
    """Adds `python -m program argv` to `out_dir`'s environment.json, with this host's versions."""
    path = os.path.join(out_dir, FILE)
    earlier = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                earlier = json.load(f)
        except ValueError:  # cut short by a host taken back mid-write; the results beside it still stand
            pass
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": f"python -m {program} " + shlex.join(argv)}
    record = {**environment(), "runs": [*pop_runs(earlier), run]}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def recorded_option(runs: list[dict], option: str) -> str | None:
    """The value the latest recorded command gave `option` (e.g. "--max-loras"), None where none gave it."""
    for run in reversed(runs):
        try:
            words = shlex.split(run.get("command", ""))
        except ValueError:
            continue
        for at, word in enumerate(words):
            if word == option and at + 1 < len(words):
                return words[at + 1]
            if word.startswith(option + "="):
                return word.split("=", 1)[1]
    return None

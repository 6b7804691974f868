"""Start, watch and stop a `vllm serve` process (used by the demo, the tests and the benchmarks)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable


def cpu_defaults(workers: int) -> dict[str, str]:
    """vLLM-CPU settings that let `workers` (TP x PP) worker processes share a small machine (ignored on GPUs): the
    server's own core split (vllm_bdlora.serve.cpu_defaults) and a fixed 1 GiB KV cache per worker, so that tests
    and benchmarks do not size it from the machine's free memory."""
    from vllm_bdlora.serve.cpu_defaults import KV_CACHE_SPACE
    from vllm_bdlora.serve.cpu_defaults import cpu_defaults as server_defaults

    env = {KV_CACHE_SPACE: "1"}
    if workers > 1:  # as on a machine with one NUMA node, whatever this one has
        env |= server_defaults(workers, env, sorted(os.sched_getaffinity(0)), nodes=1, free_gib=0.0)
    return env


LISTEN_PORTS_FLOOR = 20000  # under it: Ray's worker ports (10002-19999) and well-known services


def ephemeral_port_range() -> tuple[int, int]:
    """The ports this machine's kernel hands out to sockets bound to port 0 and to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(field) for field in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now on every interface for a server this process starts next, chosen below the kernel's ephemeral
    range. A port the kernel chose (bind to port 0) is one it may hand again to any socket bound to port 0 before the
    server binds it: a running vLLM engine on CPU opens a few dozen such listeners (its workers' gloo connections),
    and a server that lost its port to one of them either failed to start or, worse, left its clients connected to
    a listener that accepts and never answers. Ports below the range are never chosen by the kernel; a port this
    process already handed out is not handed out again. Where the range leaves no room below it, the kernel
    chooses."""
    low, _ = ephemeral_port_range()
    candidates = [port for port in range(LISTEN_PORTS_FLOOR, low) if port not in _handed_out]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    command: list[str], log_path: str, workers: int, env: dict[str, str] | None = None, fixed_cpu_settings: bool = True
) -> subprocess.Popen:
    """Start `command` with its output in `log_path`, in `env` (default: this process's environment) and, where
    `fixed_cpu_settings`, `cpu_defaults(workers)` under it; without them the server runs as a user's `vllm serve` would
    (the demo's servers run the commands it prints). The server leads a process group of its own, so that
    `stop_server` reaches its engine and worker processes too."""
    environment = dict(env if env is not None else os.environ)
    if fixed_cpu_settings:
        environment = cpu_defaults(workers) | environment
    with open(log_path, "w") as log:
        return subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    log_path: str,
    timeout: float,
    progress: Callable[[str], None] | None = None,
    route: str = "/health",
    name: str = "vllm serve",
) -> None:
    """Wait for `route` (vLLM's /health; another server's readiness route, e.g. Prometheus's /-/ready) to answer 200,
    so that what is sent to `url` next reaches the server and nothing else on its port; raises with the log's last
    lines if the process exits or `timeout` passes. `progress`, if given, hears every 10 s what a vLLM server's log
    says it is doing."""
    import requests

    started = time.monotonic()
    deadline, next_report = started + timeout, started + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; last log lines:\n{tail(log_path)}")
        try:
            if requests.get(f"{url}{route}", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if progress and time.monotonic() >= next_report:
            next_report += 10
            progress(f"{time.monotonic() - started:.0f} s: {start_phase(log_path)}")
        time.sleep(1)
    last = tail(log_path)
    if not last.strip():
        last = "(none: the log is empty; the server had written nothing yet, e.g. still importing on a busy machine)\n"
    phase = f"; it was {start_phase(log_path)}" if name == "vllm serve" else ""
    raise TimeoutError(
        f"{name} was not healthy after {timeout:.0f} s (log: {log_path}{phase}); last log lines:\n{last}"
    )


@contextlib.contextmanager
def running_server(command: list[str], log_path: str, tp: int, env: dict[str, str] | None, timeout: float):
    """`command` (a `vllm serve` with `--port`) running and healthy for the block; yields (process, url). The
    server is stopped afterwards unless it already exited."""
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    proc = launch(command, log_path, tp, env)
    try:
        wait_healthy(proc, url, log_path, timeout)
        yield proc, url
    finally:
        if proc.poll() is None:
            stop_server(proc)


def stop_server(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM to the server (it shuts its engine down), SIGKILL after `grace_s`; then SIGKILL to whatever of its
    process group is left. A server stopped while it was still starting (a start timeout) may not act on SIGTERM,
    and killing only its API server left the engine and workers holding the GPUs, so the next server found no
    memory."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# What a starting server's log says it is doing, latest milestone first (a phrase of vLLM's or the plugin's log).
START_PHASES = (
    ("Loaded new LoRA adapter", "loading the --lora-modules adapters"),
    ("vllm-bdlora: adapter", "loading the --lora-modules adapters"),
    ("Starting vLLM ", "starting the HTTP server"),  # "Starting vLLM API server", in 0.32 "Starting vLLM server on"
    ("Capturing CUDA graph", "capturing CUDA graphs"),
    ("torch.compile", "compiling the model (torch.compile; cached for later starts)"),
    ("KV cache", "allocating the KV cache"),
    ("LoRA slots: ", "building the LoRA layers"),
    ("Loading weights", "loading the model's weights"),
    ("Initializing a V1 LLM engine", "starting the engine"),
)


def start_phase(path: str) -> str:
    """Where a starting server is, from its log's latest milestone (rather than whatever line came last)."""
    text = tail(path, 400)
    found = [(text.rfind(phrase), phase) for phrase, phase in START_PHASES if phrase in text]
    return max(found)[1] if found else "starting"


def tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def wait_gpu_memory_released(threshold_mib: int = 4000, timeout: float = 120) -> bool:
    """After a server stops, its workers may hold GPU memory for a while; the next server must not
    start before it is free. Only the GPUs this process may use (CUDA_VISIBLE_DEVICES) count: servers of other
    runs on the host's other GPUs are none of its business. False (and a line saying so) if it was still in use at
    `timeout`. A no-op without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    which = ["--id=" + visible] if visible else []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["nvidia-smi", *which, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        if not out or max(int(x) for x in out) < threshold_mib:
            return True
        time.sleep(1)
    print(f"GPU memory still in use after {timeout:.0f} s ({', '.join(out)} MiB on GPUs {visible or 'all'}): the next "
          "server may not find enough; `nvidia-smi` names the processes", flush=True)  # fmt: skip
    return False

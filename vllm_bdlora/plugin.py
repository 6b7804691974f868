"""Registration with vLLM. Both entry points are idempotent and cheap: vLLM calls them in every
process (API server, engine core, each worker, Ray workers) and sometimes more than once."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.bdlora")


def register_early() -> None:
    """`vllm.platform_plugins` entry point. vLLM calls every platform plugin when `current_platform`
    is first resolved, which the `vllm` console script does before it builds its parser. We never claim
    a platform (return None); we only apply the patches that must precede the parser."""
    try:
        from vllm_bdlora.kernels.triton_cache import remember_cache_dir
        from vllm_bdlora.patching.registry import apply_patches

        remember_cache_dir()
        apply_patches("early")
    except Exception:  # vLLM swallows platform-plugin errors; make ours visible
        logger.exception("vllm-bdlora: early patches failed")
    return None


def register() -> None:
    """`vllm.general_plugins` entry point."""
    from vllm_bdlora.compat import check_supported_version
    from vllm_bdlora.kernels.triton_cache import remember_cache_dir
    from vllm_bdlora.patching.registry import apply_patches

    remember_cache_dir()
    check_supported_version()
    apply_patches("early")
    applied = apply_patches("plugin")
    if applied:
        logger.debug("vllm-bdlora: patches applied in this process: %s", ", ".join(applied))

"""The one place where vllm-bdlora changes vLLM's behaviour from outside.

Every change is a `Patch` record in `registry.PATCHES` with fixed fields (what, why, how, which vLLM
versions, what would let us delete it); `patches/README.md` is generated from those records
(`python -m vllm_bdlora.patching > patches/README.md`) and a test keeps the two in step. Each record
checks, before it patches, that the upstream symbol it relies on still looks as expected, and raises
rather than patching something it does not understand.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("vllm.bdlora")

Stage = Literal["early", "plugin"]
Platform = Literal["any", "cpu"]  # "cpu": vLLM's CPU backend only, where the patched code path runs
_ORIGINAL = "__bdlora_original__"


class UpstreamContractError(RuntimeError):
    """The vLLM code a patch targets is not what the patch was written against."""


@dataclass(frozen=True)
class Patch:
    name: str
    targets: tuple[str, ...]
    stage: Stage
    versions: str
    why: str
    how: str
    removal: str
    apply: Callable[[], bool]  # True when it patched something in this call
    platform: Platform = "any"
    # True where the targets are alternatives, one per vLLM release (compat.py picks), not all patched together
    one_target_per_release: bool = False

    @property
    def platform_note(self) -> str:
        """What the patch docs add after its stage: where it applies, unless everywhere."""
        return ", CPU backend only" if self.platform == "cpu" else ""

    def applies_here(self) -> bool:
        if self.platform == "any":
            return True
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def __call__(self) -> bool:
        if not self.applies_here():
            return False
        changed = self.apply()
        if changed:
            logger.debug("vllm-bdlora: applied patch %s (%s)", self.name, ", ".join(self.targets))
        return changed


def require_parameters(func: Callable, names: tuple[str, ...], target: str) -> None:
    params = inspect.signature(inspect.unwrap(func)).parameters
    missing = [n for n in names if n not in params]
    if missing:
        raise UpstreamContractError(
            f"vllm-bdlora cannot patch {target}: its signature lacks {missing} (has {list(params)}). "
            "This vLLM version is not supported; see vllm_bdlora/compat.py."
        )


def wrap_method(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Replace `owner.name` by `make_wrapper(original)`, once; keeps static/class-method kinds."""
    raw = owner.__dict__.get(name)
    if raw is None:
        raise UpstreamContractError(f"vllm-bdlora cannot patch {owner.__qualname__}.{name}: it does not exist.")
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(function, _ORIGINAL, None) is not None:
        return False
    wrapper = make_wrapper(function)
    functools.update_wrapper(wrapper, function)
    setattr(wrapper, _ORIGINAL, function)
    if isinstance(raw, staticmethod):
        wrapper = staticmethod(wrapper)
    elif isinstance(raw, classmethod):
        wrapper = classmethod(wrapper)
    setattr(owner, name, wrapper)
    return True


def wrap_function(
    module_name: str, name: str, make_wrapper: Callable[[Callable], Callable], required: tuple[str, ...] = ()
) -> bool:
    """Replace the module-level function `module_name.name` by `make_wrapper(original)`, once, after checking that
    the original takes the `required` parameters. A module that imported the function by name keeps its own
    reference: wrap it there too."""
    module = importlib.import_module(module_name)
    function = getattr(module, name, None)
    if function is None:
        raise UpstreamContractError(f"vllm-bdlora cannot patch {module_name}.{name}: it does not exist.")
    if getattr(function, _ORIGINAL, None) is not None:
        return False
    require_parameters(function, required, f"{module_name}.{name}")
    wrapper = make_wrapper(function)
    functools.update_wrapper(wrapper, function)
    setattr(wrapper, _ORIGINAL, function)
    setattr(module, name, wrapper)
    return True


def original_of(func: Any) -> Any:
    func = getattr(func, "__func__", func)
    return getattr(func, _ORIGINAL, None)


def add_method(owner: type, name: str, function: Callable) -> bool:
    """Give `owner` a method vLLM does not have, once; raises if vLLM has since defined one of that name."""
    existing = owner.__dict__.get(name)
    if existing is function:
        return False
    if existing is not None or any(name in base.__dict__ for base in owner.__mro__[1:]):
        raise UpstreamContractError(
            f"vllm-bdlora cannot add {owner.__qualname__}.{name}: vLLM now defines it; see vllm_bdlora/compat.py."
        )
    function.__bdlora_added__ = True
    setattr(owner, name, function)
    return True

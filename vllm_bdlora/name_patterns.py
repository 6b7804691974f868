"""PEFT's module-name patterns, matched in time linear in the name.

`adapter_config.json` carries regular expressions that PEFT matches against module names: the keys of
`rank_pattern` and `alpha_pattern`, `target_modules` and `exclude_modules` when they are strings, and the entries of
`layers_pattern`. Python's `re` backtracks: a key such as `(.|.)*!` takes time exponential in the name's length, and
one call holds the interpreter lock throughout, which froze the worker's engine step for every tenant. Here every
pattern is compiled by RE2 (the `google-re2` package), whose matching time is linear in the text, and matched with
the very expressions PEFT builds around it (`PEFT_SUFFIX`, `PEFT_LAYER`, ...), so a pattern both engines accept
selects the same modules. A pattern RE2 does not take (back-references, look-around, `\\Z`) is refused, as are
patterns longer than `MAX_PATTERN_CHARS` and configs with more than `MAX_PATTERN_KEYS` keys in one pattern field:
these bound the work an adapter can ask for before any tensor is read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import re2

MAX_PATTERN_CHARS = 512
MAX_PATTERN_KEYS = 256
# Matches one adapter may ask for (modules x pattern keys): about a second of RE2 on the CPUs tried, done in calls
# of microseconds each, so the worker's step thread keeps running meanwhile. Real adapters ask for thousands.
MAX_PATTERN_MATCHES = 2**18

# PEFT's expressions around a configured pattern, in its own order. `$` becomes `\n?\z`: Python's `$` also matches
# before a final newline, RE2's only at the end.
PEFT_SUFFIX = r"(.*\.)?({})\n?\z"  # rank_pattern / alpha_pattern keys, under re.match (other.get_pattern_key)
PEFT_LAYER = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."  # a layers_pattern entry, under re.match
PEFT_ANY_LAYER = r".*?\.[^.]*\.(?P<idx>\d+)\."  # no layers_pattern: the first numbered segment
PEFT_FULL = r"(?:{})\z"  # target_modules / exclude_modules as a string, under re.fullmatch

RE2_HINT = (
    "vllm-bdlora matches module-name patterns in linear time (RE2): write them without back-references or "
    f"look-around, at most {MAX_PATTERN_CHARS} characters each and {MAX_PATTERN_KEYS} keys per field."
)

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to the client, not logged by RE2 on stderr


class PatternRefused(ValueError):
    """A pattern this module does not match (the reason is the message)."""


@functools.lru_cache(maxsize=4096)
def _compiled(expression: str):
    try:
        return re2.compile(expression, _OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternRefused(reason.split(": ", 1)[0]) from None  # RE2 appends the expression it was given


def _pattern(template: str, pattern: str):
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRefused(f"{len(pattern)} characters, over the limit of {MAX_PATTERN_CHARS}")
    return _compiled(template.format(pattern))


def first_matching_key(keys: Iterable[str], module: str) -> str | None:
    """The first key (in the config's order) PEFT's `get_pattern_key` picks for `module`, or None."""
    for key in keys:
        if _pattern(PEFT_SUFFIX, key).match(module):
            return key
    return None


def _listed(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _selected_by(field, module: str) -> bool:
    """PEFT's reading of `target_modules` / `exclude_modules`: a string is a pattern for the whole name, a list names
    modules or their dotted suffixes."""
    if isinstance(field, str):
        return bool(_pattern(PEFT_FULL, field).match(module))
    return module in field or any(module.endswith(f".{entry}") for entry in field)


def _layer_index(config: dict, module: str) -> int | None:
    layers_pattern = _listed(config.get("layers_pattern"))
    if not layers_pattern:
        found = _compiled(PEFT_ANY_LAYER).match(module)
    else:
        found = next((m for p in layers_pattern if (m := _pattern(PEFT_LAYER, p).match(module))), None)
    return int(found.group("idx")) if found else None


def peft_targets(config: dict, module: str) -> bool:
    """Whether PEFT puts a LoRA layer on `module` under `config` (its `check_target_module_exists`):
    `exclude_modules`, then `target_modules`, then `layers_to_transform` with `layers_pattern`. A config without
    `target_modules` (or PEFT's `all-linear`, which PEFT writes out as names when it saves) selects every module."""
    exclude = config.get("exclude_modules")
    if exclude and _selected_by(exclude, module):
        return False
    targets = config.get("target_modules")
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return _selected_by(targets, module)
    if module in targets:
        return True  # PEFT does not apply layers_to_transform to a name listed in full
    if not _selected_by(targets, module):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    index = _layer_index(config, module)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def matching_work_problem(config: dict, modules: int, config_file: str) -> str | None:
    """Why matching `modules` module names against the config's pattern keys is more work than one adapter may ask
    for, or None."""
    keys = len(config.get("rank_pattern") or {}) + len(config.get("alpha_pattern") or {})
    if modules * keys <= MAX_PATTERN_MATCHES:
        return None
    return (f"{config_file}: {keys} rank_pattern/alpha_pattern keys over {modules} modules ask for {modules * keys} "
            f"pattern matches, over the limit of {MAX_PATTERN_MATCHES}")  # fmt: skip


def pattern_problems(config: dict, config_file: str) -> list[str]:
    """Every pattern field of `config` that is not a pattern this module matches, or not of the type PEFT reads."""
    problems = []

    def check(field: str, pattern, template: str) -> None:
        try:
            _pattern(template, pattern)
        except PatternRefused as e:
            problems.append(f"{config_file}: {field} {pattern[:80]!r} is not a pattern vllm-bdlora matches ({e})")

    for field in ("rank_pattern", "alpha_pattern"):
        keys = list(config.get(field) or {})
        if len(keys) > MAX_PATTERN_KEYS:
            problems.append(f"{config_file}: {field} has {len(keys)} keys, over the limit of {MAX_PATTERN_KEYS}")
            continue
        for key in keys:
            check(f"{field} key", key, PEFT_SUFFIX)
    for field in ("target_modules", "exclude_modules", "layers_pattern"):
        value = config.get(field)
        if value is None:
            continue
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
            problems.append(f"{config_file}: {field} must be a string or a list of strings, got {str(value)[:80]}")
        elif isinstance(value, list) and len(value) > MAX_PATTERN_KEYS:
            problems.append(f"{config_file}: {field} lists {len(value)} entries, over the limit of {MAX_PATTERN_KEYS}")
        elif field == "layers_pattern":
            for entry in _listed(value):
                check(field, entry, PEFT_LAYER)
        elif isinstance(value, str) and value != "all-linear":
            check(field, value, PEFT_FULL)
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        (isinstance(layers, int) and not isinstance(layers, bool))
        or (isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers))
    ):
        problems.append(f"{config_file}: layers_to_transform must be a layer index or a list of them, got {layers!r}")
    return problems

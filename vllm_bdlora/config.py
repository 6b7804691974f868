"""The plugin's settings, carried to every vLLM process inside `additional_config["bdlora"]`.

`additional_config` is part of vLLM's config hash and reaches Ray workers, so it is the one channel
used for the CLI flag, the JSON form and the Python API alike:

    vllm serve M --enable-bdlora ...                 # BD-LoRA and standard LoRA adapters
    vllm serve M --enable-dora ...                   # ... and DoRA adapters (standard and BD)
    vllm serve M --enable-lora --additional-config '{"bdlora": {"dora": true}}' ...
    LLM(M, enable_lora=True, additional_config={"bdlora": {}})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

CONFIG_KEY = "bdlora"
LORA_KERNELS = ("vllm", "fused", "auto")
ONE_LAUNCH_TOKEN_LIMITS = (16, 32, 64)  # the decode kernel's row tiles (kernels/plans.ROW_TILES)


@dataclass(frozen=True)
class BdLoraSettings:
    enabled: bool = False
    # DoRA needs a magnitude-scale buffer and a compose step in every adapted layer, for every batch
    # (CUDA graphs fix the layer's code path at start-up), so it is opt-in.
    dora: bool = False
    # "vllm": vLLM's own shrink/expand kernels. "fused": vllm_bdlora's routed shrink + fused expand
    # (DoRA compose folded into the expand's output write) in every BD layer. "auto" (default): the fused
    # kernels on CUDA, vLLM's elsewhere (the fused op's CPU path is a torch reference, slower than vLLM's CPU
    # LoRA ops). On H200s the fused kernels decode 1.08-1.21x faster than vLLM's at TP=1, 2 and 4 and
    # raise throughput x1.13-1.52, except TP=4 at 64 concurrent requests (x0.94, TTFT slower; not yet
    # understood): archived H200 runs at TP=1, 2 and 4. "vllm" is the way back.
    lora_kernels: str = "auto"
    # Under the fused kernels, batches of up to 16 tokens over an unquantized base (up to 64 in layers with one
    # LoRA slot, i.e. --max-loras 1) run base GEMV, shrink and expand as one kernel (kernels/decode_lora.py),
    # whose grid-wide barrier needs each of its programs on an SM at once. false: those batches take the
    # three-kernel path too (e.g. on a GPU shared with other processes through MPS, where fewer SMs may be free
    # than the GPU has). Per decoder layer at TP=4 the one kernel takes 1.09x the base GEMMs' time, the three
    # 1.63x (archived H200 runs).
    one_launch_decode: bool = True
    # The largest batch (in tokens: 16, 32 or 64) the one-launch kernel serves; 16 keeps 17-64-token decode
    # batches (concurrency above 16) on the three-kernel path, as before the kernel had 32- and 64-row tiles.
    # Per decoder layer at 32/64 tokens (one adapter) the one kernel took 0.80/0.86x the three kernels' time
    # at TP=2, 0.84/0.88x at TP=4, 0.88/0.99x at TP=1 (archived H200 runs).
    one_launch_max_tokens: int = 64
    # With --max-loras above 1 a decode batch of t tokens may mix min(t, max_loras) adapters. The one kernel shares
    # their shrinks' steps among its shrink programs, and after its barrier each token row gathers its own adapter's
    # B, so its LoRA cost follows the rows' width, not how many adapters they belong to: it serves such a layer's
    # batch only while t x (LoRA columns per GPU, BD r'/TP, per projection) stays within this many columns; larger
    # batches take the three kernels. With the default 128: BD r'=32 at TP=4 (8 columns) every batch of up to 16
    # tokens, r'=64 up to 8, r'=128 up to 4; at TP=1 rank-8 adapters up to 16 tokens, r'=32 up to 4, r'=128 one
    # token. Per decoder layer on one H100 (Llama-3.1-8B shapes, 1 to 12 adapters mixed, one per token), the one
    # kernel against the three: 8 columns at TP=4 1.13-1.27x faster up to 16 tokens; 16 columns 1.11-1.20x up to 8
    # (1.03-1.12x at 16, which this limit leaves to the three kernels); 32 columns 1.03-1.05x at 4 tokens, 0.78-0.97x
    # at 8-16; at TP=1 rank 8 1.06-1.14x up to 16 tokens, 32 columns 0.94-0.99x at 4, 128 columns 1.21x at one token
    # and 0.74-0.75x at two (bench/results/kernels/one-launch-row-width-h100). Since the same width wins at one shape
    # and loses at another, the default (None) takes, for each projection its GPU's plan table has measured, the
    # token count up to which the one kernel beat the three there (`bench.kernels.decode_lora --write-table`), and
    # 128 columns for the others (on one H100 4-12% less time per decoder layer than the rule where the two differ:
    # bench/results/kernels/one-launch-measured-rows-h100). A number applies as set to every projection: 0 keeps
    # multi-slot layers on the three kernels; a larger value serves wider batches on the one kernel.
    one_launch_max_mixed_width: int | None = None
    # And only while a batch may mix at most this many adapters (one per token, at most --max-loras). The default,
    # the 16 rows of a multi-slot layer's tile, leaves the width limit alone in force: 12 adapters in 16 tokens at
    # TP=4, BD r'=32 took 1.08x one adapter's time per decoder layer on the one kernel (one H100,
    # bench/results/kernels/one-launch-row-width-h100). 0 keeps multi-slot layers on the three kernels.
    one_launch_max_adapters: int = 16
    # Directories under which runtime adapter loads (every route) may read; empty: any path the server can read.
    # Paths are resolved (symlinks, "..", relative to the server's working directory) before they are compared.
    allowed_adapter_roots: tuple[str, ...] = ()
    # Host memory for admitted adapters, per worker, in bytes (each worker keeps its own share of every adapter it
    # admitted, vllm_bdlora/adapter_lifecycle/store.py); past it the least recently used are spilled to unlinked
    # private files in `adapter_spill_dir` and read back when a request asks for them. None: a fifth of the machine's
    # memory shared by its workers. A size string ("16GiB", "512MB") is read as bytes. The budget counts adapters'
    # bytes; on the fused kernels each adapter is one region of page-locked slabs (vllm_bdlora/image_memory.py),
    # which hold less than one slab (about 64 MiB, or one image where larger) per image width beyond their regions and
    # are kept at their peak (the budget plus the admissions and read-backs in flight).
    adapter_host_memory: int | None = None
    # GPU memory for LoRA slots, per GPU, in bytes (or a size string): the server's --max-loras is set to the slots
    # that fit (vllm_bdlora/sizing.py; logged with what a stock vLLM server would fit). None: --max-loras as given.
    lora_gpu_memory: int | None = None
    # Where spilled adapters go (files unlinked as soon as made: gone with the process); None: the system's
    # temporary directory.
    adapter_spill_dir: str | None = None
    # An adapter whose files are not read, checked and cut on every rank within this many seconds is refused (a
    # stalled network filesystem, say); the engine keeps serving while it waits.
    adapter_load_timeout_s: float = 120.0
    # Admissions that read at once on each worker (0: 2 on GPUs, 1 on the CPU backend, where they share the cores
    # with the engine). The threads share the worker's interpreter lock: on one H200, 1,024 loads took 72 s on 2
    # threads and 82 s on 1 (bench/results/admission/load-1024-adapters-tp1-h200), and 140 s on 4 where 2 took 86 s
    # on a host of the same kind.
    admission_threads: int = 0
    # The longest the engine core holds a request while workers read its spilled adapter back ahead of its step. A
    # read-back of an 8B adapter's share takes tens of milliseconds from a local disk; past this (a slow spill disk,
    # or an adapter spilled again as soon as it was read back, under a host budget too small for the traffic) the
    # request goes to the scheduler and its step reads the adapter, as it would without the hold.
    read_back_hold_s: float = 2.0
    # A request naming an adapter that is in host memory but in no GPU slot has it copied, as it arrives, into the least
    # recently used slot no request needs, so that the step that runs it does not fill it (on a GPU the copy runs on a
    # stream of its own); false fills every slot inside the step that first runs it, as vLLM does
    # (vllm_bdlora/adapter_lifecycle/fill_ahead.py).
    fill_slots_ahead: bool = True
    # GPU slots beyond the adapters one step may run (--max-loras, vLLM's scheduler limit), so that with every one of
    # those taken by an adapter with running requests, the next adapters that waiting requests name are still filled
    # ahead of the step that runs them (fill_ahead.py). Inside --lora-gpu-memory where it holds one slot more than
    # that, else beyond --max-loras; 0: the scheduler's limit is the slots, as in vLLM. Used with fill_slots_ahead.
    fill_ahead_slots: int = 1
    # With slots beyond --max-loras, a waiting request whose adapter is in no slot sits out one step while its adapter
    # is filled beside that step, instead of joining it and having the step (every running request) wait for the copy
    # (vllm_bdlora/scheduling.py); false lets it join at once, which saves that request one step.
    hold_for_slot_fills: bool = True
    # An adapter a request just named (read back, or found in memory) is not spilled before a step takes it while
    # another adapter can go instead, for at most this long: the read-backs for the requests queued behind its own
    # would otherwise spill it, and its step would read it from the spill file after all. Past this its request was
    # most likely given up.
    named_kept_s: float = 30.0
    # /health answers 503 when the engine core has not come back to its requests for this many seconds (a stopped or
    # hung worker); 0 turns the check off.
    engine_stall_timeout_s: float = 30.0
    # Once a request has waited this long for a LoRA slot, other adapters' requests stop joining the batch until it
    # has one (vllm_bdlora/scheduling.py); 0 keeps vLLM's order, under which a rarely used adapter can wait as long
    # as the popular ones keep coming.
    lora_wait_limit_s: float = 2.0
    # Adapter names that get a label value of their own on /metrics (the first seen); later ones share "other", and 0
    # exports no adapter name at all (vllm_bdlora/metrics.py).
    metrics_max_adapters: int = 100
    # On a CUDA GPU, where the user set no capture range, CUDA graphs are captured for batches of up to this many
    # tokens (vLLM's default stops at 512 or 2 x max_num_seqs), so that LoRA prefills up to it do not pay every
    # LoRA layer's launches on the host (vllm_bdlora/prefill_graphs.py); 0 keeps vLLM's range.
    prefill_graph_tokens: int = 2048

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> BdLoraSettings:
        section = (additional_config or {}).get(CONFIG_KEY)
        if section is None:
            return cls(enabled=False)
        if not isinstance(section, Mapping):
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"] must be a JSON object such as {{"enabled": true}}, got {section!r}.'
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(
                f'Unknown key(s) {unknown} in additional_config["{CONFIG_KEY}"]; known keys: {sorted(known)}.'
            )
        values = {
            "enabled": section.get("enabled", True),
            "dora": section.get("dora", False),
            "one_launch_decode": section.get("one_launch_decode", cls.one_launch_decode),
            "fill_slots_ahead": section.get("fill_slots_ahead", cls.fill_slots_ahead),
            "hold_for_slot_fills": section.get("hold_for_slot_fills", cls.hold_for_slot_fills),
        }
        for key, value in values.items():
            if not isinstance(value, bool):
                raise ValueError(f'additional_config["{CONFIG_KEY}"]["{key}"] must be true or false, got {value!r}.')
        kernels = section.get("lora_kernels", cls.lora_kernels)
        if kernels not in LORA_KERNELS:
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["lora_kernels"] must be one of {list(LORA_KERNELS)}, '
                f"got {kernels!r}."
            )
        max_tokens = section.get("one_launch_max_tokens", cls.one_launch_max_tokens)
        if max_tokens not in ONE_LAUNCH_TOKEN_LIMITS:  # True == 1 is not among them either
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["one_launch_max_tokens"] must be one of '
                f"{list(ONE_LAUNCH_TOKEN_LIMITS)}, got {max_tokens!r}."
            )
        mixed_width = section.get("one_launch_max_mixed_width", cls.one_launch_max_mixed_width)
        if mixed_width is not None and (isinstance(mixed_width, bool) or not isinstance(mixed_width, int)
                                        or mixed_width < 0):  # fmt: skip
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["one_launch_max_mixed_width"] must be an integer >= 0 (LoRA '
                f"columns per GPU) or null (the GPU's measured limits), got {mixed_width!r}."
            )
        graph_tokens = section.get("prefill_graph_tokens", cls.prefill_graph_tokens)
        if isinstance(graph_tokens, bool) or not isinstance(graph_tokens, int) or graph_tokens < 0:
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["prefill_graph_tokens"] must be an integer >= 0 (tokens; 0 keeps '
                f"vLLM's CUDA graph capture range), got {graph_tokens!r}."
            )
        roots = section.get("allowed_adapter_roots", [])
        if isinstance(roots, str) or not isinstance(roots, (list, tuple)) or not all(isinstance(r, str) for r in roots):
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["allowed_adapter_roots"] must be a list of directories, got '
                f"{roots!r}."
            )
        spill_dir = section.get("adapter_spill_dir")
        if spill_dir is not None and not isinstance(spill_dir, str):
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"]["adapter_spill_dir"] must be a directory, got {spill_dir!r}.'
            )
        host_memory = section.get("adapter_host_memory")
        if host_memory is not None:
            host_memory = parse_bytes(host_memory, "adapter_host_memory")
        gpu_memory = section.get("lora_gpu_memory")
        if gpu_memory is not None:
            gpu_memory = parse_bytes(gpu_memory, "lora_gpu_memory")
        seconds = {
            key: _non_negative_number(section.get(key, getattr(cls, key)), key)
            for key in (
                "adapter_load_timeout_s",
                "engine_stall_timeout_s",
                "lora_wait_limit_s",
                "read_back_hold_s",
                "named_kept_s",
            )
        }
        threads = section.get("admission_threads", cls.admission_threads)
        max_named = section.get("metrics_max_adapters", cls.metrics_max_adapters)
        max_mixed = section.get("one_launch_max_adapters", cls.one_launch_max_adapters)
        spare_slots = section.get("fill_ahead_slots", cls.fill_ahead_slots)
        counts = (("admission_threads", threads), ("metrics_max_adapters", max_named),
                  ("one_launch_max_adapters", max_mixed), ("fill_ahead_slots", spare_slots))  # fmt: skip
        for key, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f'additional_config["{CONFIG_KEY}"]["{key}"] must be an integer >= 0, got {value!r}.')
        return cls(
            enabled=values["enabled"],
            dora=values["enabled"] and values["dora"],
            lora_kernels=kernels,
            one_launch_decode=values["one_launch_decode"],
            fill_slots_ahead=values["fill_slots_ahead"],
            fill_ahead_slots=spare_slots,
            hold_for_slot_fills=values["hold_for_slot_fills"],
            one_launch_max_tokens=max_tokens,
            one_launch_max_mixed_width=mixed_width,
            one_launch_max_adapters=max_mixed,
            allowed_adapter_roots=tuple(roots),
            adapter_host_memory=host_memory,
            lora_gpu_memory=gpu_memory,
            adapter_spill_dir=spill_dir,
            admission_threads=threads,
            metrics_max_adapters=max_named,
            **seconds,
            prefill_graph_tokens=graph_tokens,
        )

    @property
    def spare_slots(self) -> int:
        """GPU slots kept beyond the adapters one step may run (`fill_ahead_slots`, where slots are filled ahead)."""
        return self.fill_ahead_slots if self.enabled and self.fill_slots_ahead else 0

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> BdLoraSettings:
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))


def with_bdlora_enabled(
    additional_config: Mapping[str, Any] | None,
    dora: bool = False,
    allowed_adapter_roots: list[str] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """`additional_config` with the BD-LoRA section switched on (and DoRA, adapter roots and any other `settings`
    given), keeping whatever else it holds."""
    merged = dict(additional_config or {})
    section = dict(merged.get(CONFIG_KEY) or {})
    section["enabled"] = True
    if dora:
        section["dora"] = True
    if allowed_adapter_roots:
        section["allowed_adapter_roots"] = list(allowed_adapter_roots)
    section.update({key: value for key, value in settings.items() if value is not None})
    merged[CONFIG_KEY] = section
    return merged


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_bytes(value, key: str) -> int:
    """A size in bytes: an integer, or a string such as "16GiB", "512 MB" or "1e9"."""
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        found = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
        if found and found.group(2).upper() in _UNITS:
            try:
                number = float(found.group(1))
            except ValueError:
                number = -1.0
            if number >= 0:
                return int(number * _UNITS[found.group(2).upper()])
    raise ValueError(
        f'additional_config["{CONFIG_KEY}"]["{key}"] must be a size in bytes (an integer, or a string such as '
        f'"16GiB" or "512MB"), got {value!r}.'
    )


def _non_negative_number(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f'additional_config["{CONFIG_KEY}"]["{key}"] must be a number >= 0 (seconds), got {value!r}.')
    return float(value)

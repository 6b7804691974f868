"""CUDA graphs for LoRA prefills: the capture range a BD-LoRA server asks vLLM for when the user chose none.

vLLM captures CUDA graphs for batches of up to min(2 x max_num_seqs, 512) tokens (1024 on Blackwell); a longer
batch, such as a single 1024-token prompt, runs its compiled model eagerly, and every LoRA layer's launches are
then paid on the host, step after step. For a LoRA model that host work, not the GPU, sets the prefill time: a
1024-token prompt of a Llama-3.1-8B shape at TP=1 took 68-93 ms to its first token eagerly against 44 ms as a graph,
the base model 36 ms (bench/results/serving/tp1-llama3.1-8b-h200*). So a BD-LoRA server on a CUDA GPU captures
graphs up to `prefill_graph_tokens` (the plugin's setting) unless the user set a capture range, turned graphs off
or ran eagerly. vLLM builds the sizes itself (its usual grid, every 16 tokens above 256), so a prompt is padded to at
most 15 more tokens; each added size is captured once with and once without LoRA, which costs start-up time and
graph memory (vLLM's "Graph capturing finished" line reports both; measured figures:
bench/results/serving/tp1-llama3.1-8b-h100-ttft/startup.md). Longer prefills than the range stay eager, where the
GPU's work has grown past the host's.
"""

from __future__ import annotations

import copy
import logging

from vllm_bdlora.config import BdLoraSettings

logger = logging.getLogger("vllm.bdlora")

# vLLM's own ceiling when nothing is set (Hopper and older), for the log line.
VLLM_DEFAULT_CEILING = 512


def vllm_capture_grid(limit: int) -> list[int]:
    """The batch sizes vLLM captures up to `limit` when given only a ceiling: 1, 2, 4, every 8 tokens below 256,
    every 16 from 256 (vLLM's own grid, for the log line)."""
    return (
        [n for n in (1, 2, 4) if n <= limit] + list(range(8, min(limit + 1, 256), 8)) + list(range(256, limit + 1, 16))
    )


def prefill_capture_limit(engine_args, settings: BdLoraSettings, on_cuda: bool) -> int | None:
    """The `max_cudagraph_capture_size` to give vLLM, or None to leave its configuration as it is: off CUDA, with
    the setting at 0, under --enforce-eager, with graphs turned off or where the user chose a capture range."""
    wanted = settings.prefill_graph_tokens
    compilation = engine_args.compilation_config
    if not (on_cuda and wanted and settings.enabled) or engine_args.enforce_eager:
        return None
    if compilation.max_cudagraph_capture_size is not None or compilation.cudagraph_capture_sizes is not None:
        return None
    mode = compilation.cudagraph_mode
    if mode is not None and str(getattr(mode, "name", mode)).upper() == "NONE":
        return None
    if engine_args.max_num_batched_tokens:  # vLLM never runs a larger batch, so never captures one
        wanted = min(wanted, engine_args.max_num_batched_tokens)
    return wanted


def capture_prefills(engine_args, settings: BdLoraSettings, on_cuda: bool) -> int | None:
    """Set the capture range `prefill_capture_limit` picks on `engine_args` and log it; returns it."""
    limit = prefill_capture_limit(engine_args, settings, on_cuda)
    if limit is None:
        return None
    # A copy: the parser's default configuration object may be shared with later parses.
    engine_args.compilation_config = copy.copy(engine_args.compilation_config)
    engine_args.compilation_config.max_cudagraph_capture_size = limit
    logger.info(
        "vllm-bdlora: capturing CUDA graphs for batches of up to %d tokens (vLLM's default stops at min(2 x "
        "max_num_seqs, %d)), so that LoRA prefills of up to %d tokens run as graphs instead of paying every LoRA "
        "layer's launches on the host. Cost: %d graph sizes in all, each captured with and without LoRA, in start-up "
        "time and graph memory (vLLM's 'Graph capturing finished' line reports both). To keep vLLM's range, set "
        "additional_config {\"bdlora\": {\"prefill_graph_tokens\": 0}} or a capture range of your own "
        "(--compilation-config '{\"max_cudagraph_capture_size\": N}').",
        limit, VLLM_DEFAULT_CEILING, limit, len(vllm_capture_grid(limit)),
    )  # fmt: skip
    return limit

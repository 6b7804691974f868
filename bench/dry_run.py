"""A stand-in for `python3` that checks the command lines of the GPU hosts' scripts (`bench/hosts/*.sh`) on a machine
without a GPU: put a `python3` that runs `python -m bench.dry_run "$@"` first on PATH and run the script as written.

* `python3 -m bench.X ARGS` for a benchmark with a `parse_args` is parsed by that benchmark's own parser (a usage
  error exits 2, as it would on the host), and every `vllm serve` command it would start (`server_commands`) is parsed
  by vLLM's own `vllm serve` parser, with this plugin's flags: a quoting mistake that strips a JSON argument's quotes
  fails here, not after a GPU host was brought up.
* Anything else (pytest, pip, `-c` probes, benchmarks without a parser) is printed and succeeds.

Every command is printed on one line, `dry-run: python3 ...`, then `dry-run: vllm serve ...` per server.
"""

from __future__ import annotations

import importlib
import shlex
import sys


def check_server_command(parser, command: list[str]) -> None:
    """Parse `vllm serve ...` as vLLM would (exits 2 with vLLM's message where it would not start)."""
    assert command[:2] == ["vllm", "serve"], command
    print("dry-run: " + shlex.join(command), flush=True)
    parser.parse_args(command[2:])


def main(argv: list[str]) -> int:
    print("dry-run: python3 " + shlex.join(argv), flush=True)
    if len(argv) < 2 or argv[0] != "-m" or not argv[1].startswith("bench."):
        return 0
    module = importlib.import_module(argv[1])
    parse_args = getattr(module, "parse_args", None)
    if parse_args is None:
        return 0
    args = parse_args(argv[2:])
    commands = getattr(module, "server_commands", lambda _: [])(args)
    if commands:
        from vllm_bdlora.compat import serve_arg_parser

        parser = serve_arg_parser()
        for command in commands:
            check_server_command(parser, command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

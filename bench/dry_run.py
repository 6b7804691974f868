"""A stand-in for `python3` that checks the command lines of the GPU hosts' scripts (`bench/hosts/*.sh`) on a machine
without a GPU: put a `python3` that runs `python -m bench.dry_run "$@"` first on PATH and run the script as written.

* `python3 -m bench.X ARGS` for a benchmark with a `parse_args` is parsed by that benchmark's own parser (a usage
  error exits 2, as it would on the host), and every `vllm serve` command it would start (`server_commands`) is parsed
  by vLLM's own `vllm serve` parser, with this plugin's flags: a quoting mistake that strips a JSON argument's quotes
  fails here, not after a GPU host was brought up.
* Anything else (pytest, pip, `-c` probes, benchmarks without a parser) is printed and succeeds.

Every command is printed on one line, `dry-run: python3 ...`, then `dry-run: vllm serve ...` per server.

Importing vLLM's parser takes seconds, and a script runs many commands: `python -m bench.dry_run --host SOCKET`
imports it once and answers each command in a fork of itself. A stand-in `python3` run with `BDLORA_DRY_RUN_HOST`
set to that socket hands its command line, directory, environment and standard streams to the host and exits with
the fork's status, so each command is checked exactly as it would be alone.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import signal
import socket
import sys
import traceback

HOST_VARIABLE = "BDLORA_DRY_RUN_HOST"
# The benchmarks whose servers a host's forks check: imported by the host, once.
BENCHMARKS_WITH_SERVERS = ("bench.sweep", "bench.many_adapters")
_parser = None  # vLLM's `vllm serve` parser, built once per process


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
        parser = serve_parser()
        for command in commands:
            check_server_command(parser, command)
    return 0


def serve_parser():
    global _parser
    if _parser is None:
        from vllm_bdlora.compat import serve_arg_parser

        _parser = serve_arg_parser()
    return _parser


def _send_message(connection: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(connection, [len(data).to_bytes(8, "big") + data], list(fds))


def _receive_message(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        more = connection.recv(1 << 20)
        if not more:
            raise ConnectionError("the message ended early")
        data += more
    return json.loads(data[8 : 8 + size]), fds


def serve(socket_path: str) -> int:
    """The host: vLLM's parser and the benchmarks imported once, each connection's command run in a fork."""
    for name in BENCHMARKS_WITH_SERVERS:
        importlib.import_module(name)
    serve_parser()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forks are reaped by the kernel; each reports its own status
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print(f"dry-run host listening on {socket_path}", flush=True)
    while True:
        connection, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(_run_forwarded(connection))
        connection.close()


def _run_forwarded(connection: socket.socket) -> int:
    """In a fork of the host: the client's command with its directory, environment and streams; the status goes
    back to the client."""
    status = 1
    try:
        request, fds = _receive_message(connection)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        try:
            status = main(request["argv"])
        except SystemExit as exit_:
            code = exit_.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if not isinstance(code, int) and code is not None:
                print(code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        with_status = json.dumps({"status": status}).encode()
        try:
            connection.sendall(with_status)
        finally:
            connection.close()
    return status


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def forward(socket_path: str, argv: list[str]) -> int:
    """A stand-in `python3` whose command a host runs: its status, or 1 where the host gave none."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(socket_path)
        streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
        _send_message(connection, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}, streams)
        reply = b""
        while chunk := connection.recv(4096):
            reply += chunk
    if not reply:
        print(f"dry-run: the host at {socket_path} gave no status for: python3 {shlex.join(argv)}", file=sys.stderr)
        return 1
    return json.loads(reply)["status"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--host"]:
        sys.exit(serve(sys.argv[2]))
    if os.environ.get(HOST_VARIABLE):
        sys.exit(forward(os.environ[HOST_VARIABLE], sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))

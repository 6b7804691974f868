"""Where a server's threads spend one phase of a benchmark (e.g. loading 1,024 adapters): py-spy samples every process
of the server (API server, engine core, workers) while the phase runs, twice side by side: every thread, idle or not
(`--idle`), and only the thread holding the interpreter lock (`--gil`). py-spy is the maintained sampler users reach
for; this module only starts and stops it around a phase and reads its collapsed stacks back as a table.

    with recording(server_pid, "OUT/logs/load-profile-bdlora"):   # -> ...-all.txt, ...-gil.txt (py-spy's raw format)
        run_the_phase()
    python -m bench.sampled_stacks OUT/logs/load-profile-bdlora-gil.txt [--top 12]   # per thread: samples, top frames

py-spy reads the processes' memory without stopping them (`--nonblocking`), so the phase runs at its own speed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import shutil
import signal
import subprocess
import sys

SAMPLES_PER_S = 100
VIEWS = {"all": ["--idle"], "gil": ["--gil"]}


def record_command(pid: int, path: str, view_args: list[str]) -> list[str]:
    return ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking",
            "--rate", str(SAMPLES_PER_S), "--format", "raw", "--output", path, *view_args]  # fmt: skip


@contextlib.contextmanager
def recording(pid: int, prefix: str):
    """py-spy records of process `pid` and its children while the block runs: PREFIX-all.txt, PREFIX-gil.txt."""
    if shutil.which("py-spy") is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy (or leave the profile option off)")
    with contextlib.ExitStack() as logs:  # py-spy's own messages, one log per sampler, closed once it has exited
        samplers = [subprocess.Popen(record_command(pid, f"{prefix}-{view}.txt", args), stdout=subprocess.DEVNULL,
                                     stderr=logs.enter_context(open(f"{prefix}-{view}.log", "w")))  # fmt: skip
                    for view, args in VIEWS.items()]  # fmt: skip
        try:
            yield
        finally:
            for sampler in samplers:
                sampler.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
            for sampler in samplers:
                try:
                    sampler.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    sampler.kill()
                    sampler.wait()


def owner_of(frames: list[str]) -> tuple[str, int]:
    """The innermost process and the thread of a stack's leading frames ("process PID:"COMMAND"" per process down the
    tree, then "thread (TID): NAME"), and how many frames they take. Threads of one pool or one kind (names ending in a
    number, e.g. one thread per admission) count as one: the table is about kinds of work, not thread instances."""
    process, depth = "", 0
    while depth < len(frames) and frames[depth].startswith("process "):
        process = frames[depth].partition(":")[2].strip('"')
        depth += 1
    process = process if len(process) <= 40 else process[:37] + "..."
    thread = ""
    if depth < len(frames) and frames[depth].startswith("thread ("):
        thread = re.sub(r"[-_]?\d+$", "-N", frames[depth].partition(": ")[2])
        depth += 1
    return f"{process} / {thread}" if thread else process, depth


def read_stacks(path: str) -> dict[str, collections.Counter]:
    """Collapsed stacks ("process ...;thread ...;frame;...;frame COUNT") as {process and thread: Counter of stacks}."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            owner, depth = owner_of(frames)
            threads[owner][tuple(frames[depth:])] += int(count)
    return threads


def frame_name(frame: str) -> str:
    """`function (path/to/module.py:LINE)` -> `function (module.py:LINE)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def table(path: str, top: int) -> str:
    """Per thread, busiest first: its samples (and seconds at SAMPLES_PER_S), the frames most samples end in, and the
    frames most samples are inside (a function's own time and its callees')."""
    lines = []
    threads = read_stacks(path)
    for owner, stacks in sorted(threads.items(), key=lambda item: -sum(item[1].values())):
        total = sum(stacks.values())
        lines.append(f"{owner}: {total} samples ({total / SAMPLES_PER_S:.1f} s)")
        innermost, anywhere = collections.Counter(), collections.Counter()
        for stack, count in stacks.items():
            innermost[frame_name(stack[-1]) if stack else "(no Python frame)"] += count
            for frame in {frame_name(frame) for frame in stack}:
                anywhere[frame] += count
        for heading, counts in (("ending in", innermost), ("inside", anywhere)):
            lines.append(f"  {heading}:")
            # frames every sample of the thread is inside (its bootstrap) say nothing
            shown = [(frame, count) for frame, count in counts.most_common() if count < total]
            for frame, count in shown[:top]:
                lines.append(f"  {count:7d} {100 * count / total:5.1f}%  {frame}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a py-spy record in its raw format")
    p.add_argument("--top", type=int, default=12, help="frames shown per thread")
    args = p.parse_args(argv)
    print(table(args.path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

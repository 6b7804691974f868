"""Periodic Python stack dumps of every process started with this folder on PYTHONPATH, for finding where a
silent start-up goes (e.g. the 80-90 s a server's workers spend after CUDA-graph capture on a fresh
multi-GPU host). Off unless BENCH_DUMP_STACKS_EVERY_S is set; stops at BENCH_DUMP_STACKS_UNTIL (Unix time).

    PYTHONPATH=bench/hosts/stack_dumps BENCH_DUMP_STACKS_EVERY_S=20 \
    BENCH_DUMP_STACKS_UNTIL=$(( $(date +%s) + 300 )) python3 -m bench.sweep ...

Each dump goes to the process's stderr (the server log), every thread, headed by faulthandler's banner."""

import faulthandler
import os
import sys
import threading
import time

_every = float(os.environ.get("BENCH_DUMP_STACKS_EVERY_S", "0") or 0)
_until = float(os.environ.get("BENCH_DUMP_STACKS_UNTIL", "0") or 0)
if _every > 0 and (not _until or time.time() < _until):
    faulthandler.dump_traceback_later(_every, repeat=True, file=sys.stderr)
    if _until:
        _stopper = threading.Timer(max(0.0, _until - time.time()), faulthandler.cancel_dump_traceback_later)
        _stopper.daemon = True
        _stopper.start()

"""Run a benchmark function in a fresh interpreter, under a time limit, and keep what it measured.

A worker is a generator function in a ``layerwise.benchmarks`` module that yields result rows (dicts of
JSON values). :func:`run_worker` runs it in a new process (``python -m layerwise.benchmarks.workers``), which
prints each row as one line prefixed by ``ROW_PREFIX`` as soon as it is measured, so the rows measured
before a crash or the time limit are kept; other output (warnings, progress) is ignored but for the last
line of stderr, which becomes the reason a worker did not finish.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROW_PREFIX = "@@layerwise-row "

#: How glibc's malloc treats a load benchmark's memory in its worker processes (environment variables per regime).
#: "fresh": every allocation of 128 KiB or more is mapped anew and unmapped when freed (MALLOC_MMAP_THRESHOLD_, which
#: also turns off glibc's adaptive threshold), so every load pays the page faults of the memory it writes, as the one
#: load of a real process does. "reused": nothing is unmapped or trimmed, so a load after the first reuses the pages
#: the one before it freed (a loop of loads in one process). Left to glibc's own heuristics, which of the two a
#: method's second load got depended on the sizes it happened to free: two runs of the same code timed the floor at
#: 0.22 s and at 0.5 s, so every method of a run gets one regime.
PAGES_ENV = {
    "fresh": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    "reused": {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)},
}


@dataclass
class WorkerResult:
    """What a worker process left: its rows (in order) and, when it did not finish, why."""

    rows: list[dict] = field(default_factory=list)
    error: str | None = None  # None: exited 0; else "timed out after N s" or the last line of stderr
    seconds: float = 0.0  # wall time of the process


def _rows(stdout: str | bytes | None) -> list[dict]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    return [json.loads(line[len(ROW_PREFIX) :]) for line in (stdout or "").splitlines() if line.startswith(ROW_PREFIX)]


def run_worker(
    module: str, function: str, kwargs: dict, timeout: float | None = None, env: dict[str, str] | None = None
) -> WorkerResult:
    """Run ``layerwise.benchmarks.<module>.<function>(**kwargs)`` in a fresh interpreter (``module`` may also
    be a full dotted name: "pkg.mod").

    Args:
        kwargs: JSON-serializable keyword arguments.
        timeout: seconds before the process is killed (None: no limit).
        env: environment variables set for the process on top of this one's (e.g. a :data:`PAGES_ENV` regime).
    Returns:
        a :class:`WorkerResult`; never raises for a failing or slow worker.
    """
    cmd = [sys.executable, "-m", "layerwise.benchmarks.workers", module, function, json.dumps(kwargs)]
    start = time.perf_counter()
    # a session of its own: on timeout the whole group goes (compile workers too), so the pipes close
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        return WorkerResult(_rows(stdout), f"timed out after {timeout:.0f} s", time.perf_counter() - start)
    result = WorkerResult(_rows(stdout), None, time.perf_counter() - start)
    if proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        result.error = lines[-1] if lines else f"exit status {proc.returncode}, no output"
    return result


def main(argv: list[str]) -> int:
    """Entry of the worker process: ``MODULE FUNCTION KWARGS_JSON``; prints each yielded row at once."""
    module, function, kwargs = argv
    fn = getattr(importlib.import_module(module if "." in module else f"layerwise.benchmarks.{module}"), function)
    for row in fn(**json.loads(kwargs)):
        print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

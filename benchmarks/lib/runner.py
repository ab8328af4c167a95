"""Running the benchmarks: the alternating runner, benchmark scripts as subprocesses, free ports.

Two sides measured in one run alternate, each once per round, so that drift on the machine (other
work starting or stopping, the CPU's clock) hits both alike; their ratio is then read round by round
as well as from the medians. A script that measures in a fresh process runs another benchmark
module (or itself, as a child) as ``python -m benchmarks.<name>`` with the repository root as its
working directory, in this interpreter or another venv's, and reads its one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]  # the repository root: conf/, train.py, benchmarks/


# ----------------------------------------------------------------------------- alternation
def alternate(
    sides: dict[str, Callable[[int], Any]], rounds: int, abba: bool = False, done: Callable[[Any], bool] | None = None
) -> dict[str, list]:
    """Each side's results over ``rounds`` rounds, the sides run in turn within a round:
    ``sides[name](r)`` for round ``r``. ``abba``: odd rounds run the sides in reverse order.
    ``done(result)`` true: that side is not run again (a variant the config refuses)."""
    results: dict[str, list] = {name: [] for name in sides}
    for r in range(rounds):
        order = list(sides.items())
        if abba and r % 2:
            order.reverse()
        for name, fn in order:
            if done is not None and results[name] and done(results[name][-1]):
                continue
            results[name].append(fn(r))
    return results


def ratios(a: Sequence, b: Sequence, key: str | None = None) -> list[float]:
    """Round by round, ``a`` over ``b`` (of ``[key]`` when given): each pair was measured minutes
    apart at most, so their ratio cancels slow drift."""
    if key is not None:
        a, b = [x[key] for x in a], [x[key] for x in b]
    return [x / y for x, y in zip(a, b)]


# ----------------------------------------------------------------------------- subprocesses
def module_cmd(name: str, *args: str, python: str | None = None) -> list[str]:
    """The command that runs ``benchmarks.<name>`` as a module (from ``ROOT``: pass ``cwd=ROOT``),
    under ``python`` (another venv's interpreter, a path relative to this process's working
    directory: made absolute, symlinks kept, since a venv's python is one) or this one. Paths among
    ``args`` are the caller's to make absolute (``absolute``)."""
    if python and os.sep in python:
        python = absolute(python)
    return [python or sys.executable, "-m", f"benchmarks.{name}", *args]


def absolute(path: str | Path) -> str:
    """``path`` from this process's working directory, for a child that runs from ``ROOT``."""
    return os.path.abspath(path)


def last_json_line(stdout: str) -> dict:
    """The last line that is a JSON object: a library (vLLM's engine, TRL) may print to stdout too."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def run_json(cmd: list[str], what: str, env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root and return its JSON line; exit with the end of its
    stderr if it fails."""
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if p.returncode:
        sys.exit(f"{what} failed:\n{p.stderr[-4000:]}")
    return last_json_line(p.stdout)


def run_benchmark(
    name: str, workload: str, model_dir: str, threads: int | None, python: str | None = None, extra: Sequence[str] = ()
) -> dict:
    """``benchmarks.<name>`` on the workload in a fresh process (``python``: another venv's); its JSON line."""
    args = ["--workload", workload, "--model-dir", model_dir, *extra]
    if threads:
        args += ["--threads", str(threads)]
    return run_json(module_cmd(name, *args, python=python), f"benchmarks.{name}")


def mean_length(result: dict) -> float:
    """A run's mean completion length, from its JSON line (``throughput``'s or a TRL baseline's)."""
    return round(result["generated_tokens_per_s"] * result["total_s"] / result["episodes"], 1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (MASTER_PORT for a process group on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

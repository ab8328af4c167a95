"""The command-line options the benchmark scripts have in common."""

from __future__ import annotations

import argparse
import sys


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first line; its usage line says how it runs
    (``python -m benchmarks.<name>``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = f"python -m {spec.name}" if spec is not None and spec.name.startswith("benchmarks.") else None
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])


def add_workload(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--workload``, a name of ``workloads.WORKLOADS``; required when there is no ``default``."""
    from benchmarks.lib.workloads import WORKLOADS

    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=default, required=default is None)


def add_model_dir(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-dir", help="where to save / reuse the workload's models (default: temp)")


def add_threads(ap: argparse.ArgumentParser, help: str = "torch.set_num_threads (default: torch's choice)") -> None:
    ap.add_argument("--threads", type=int, help=help)


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given."""
    if threads:
        import torch

        torch.set_num_threads(threads)

"""SIGTERM stops a run cleanly, in any phase, under any strategy.

Clusters stop a job with SIGTERM and SIGKILL it a grace period later (SLURM, Kubernetes: 30 s
by default). Python's default for SIGTERM ends the process on the spot: no ``finally`` runs, so a
recipe build leaves its temporary directory behind, and during PPO everything since the last
periodic checkpoint is lost. Lightning's own handler, in turn, stops the loop with a
``SystemExit`` whose status is 0, so a scheduler sees success, and writes no checkpoint. Here:

- outside PPO training (building a recipe, loading models, the SFT and reward-model stages,
  evaluation, export) the signal raises ``Preempted`` where the program is, so every ``finally``
  and context manager cleans up (a recipe build removes its temporary directory);
- during PPO training (``StopOnPreemption``) the signal only sets a flag: the current iteration
  finishes, all ranks agree (a rank that got no signal stops with the others), ``last.ckpt`` is
  written, and then ``Preempted`` is raised. The stop comes within one iteration of the signal;
  on a model whose iterations take longer than the grace period, ask the scheduler to signal
  earlier (SLURM: ``--signal=TERM@120``).

``train.py`` turns ``Preempted`` into exit status 143 (128 + SIGTERM) and one line with the
command that resumes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Iterator

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)

EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Preempted(BaseException):
    """The run was stopped by SIGTERM. ``checkpoint`` is the file to resume from (None when the
    stop came before PPO training had anything to save).

    A ``BaseException``, like ``KeyboardInterrupt``: ``except Exception`` blocks (a sweep's
    per-job guard, a library's retry loop) must not swallow a stop request.
    """

    def __init__(self, message: str, checkpoint: Path | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint


class _State:
    requested = False  # a SIGTERM arrived
    deferred = False  # inside PPO training: StopOnPreemption stops at the iteration's end


def _on_sigterm(signum, frame) -> None:
    if _State.requested:  # already stopping: let the cleanup finish
        return
    _State.requested = True
    if not _State.deferred:
        raise Preempted("stopped by SIGTERM")


@contextlib.contextmanager
def handle_sigterm() -> Iterator[None]:
    """Install the SIGTERM handler for the duration of a job (the previous one is restored).
    Only the main thread can install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _State.requested, _State.deferred = False, False
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _State.requested, _State.deferred = False, False


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where the stop writes: the ``ModelCheckpoint``'s ``last.ckpt`` (the file a resumed run
    reads), or ``<default_root_dir>/checkpoints/last.ckpt`` when no checkpoint callback is set."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


class StopOnPreemption(L.Callback):
    """Defer SIGTERM to the end of the current PPO iteration, then checkpoint and stop.

    Lightning registers its own SIGTERM handler just before the loop starts; ``on_train_start``
    replaces it with ``handle_sigterm``'s (Lightning restores the previous handler at teardown).
    At every iteration's end the ranks agree on whether any of them was signalled (one boolean
    all-reduce), so every rank writes its part of the same checkpoint (a collective under
    sharded strategies) and stops after the same iteration.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)
        _State.deferred = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stop_if_requested(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_if_requested(trainer)  # signalled after the last iteration's check
        _State.deferred = False

    @staticmethod
    def _stop_if_requested(trainer) -> None:
        if not trainer.strategy.reduce_boolean_decision(_State.requested, all=False):
            return
        _State.requested = True  # ranks that got no signal stop too, and ignore a late one
        _State.deferred = False
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: a resumable checkpoint
        raise Preempted(
            f"stopped by SIGTERM after PPO iteration {trainer.global_step - 1}; checkpoint written to {path}",
            checkpoint=path,
        )

    def on_exception(self, trainer, pl_module, exception) -> None:
        _State.deferred = False

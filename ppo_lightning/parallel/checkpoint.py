"""Checkpoint writes that a kill or a full disk cannot corrupt.

Lightning writes a checkpoint straight to its final path; a run killed mid-write leaves a
truncated ``last.ckpt`` and nothing to resume from. ``AtomicCheckpointIO`` writes to a temporary
file in the same directory, flushes it to disk, then renames it over the target: a reader (or a
resumed run) sees the old checkpoint or the new one, never half of one.

A write that fails (no space left, a quota, a read-only mount) removes its temporary file and
raises ``CheckpointWriteError``, which names the file and the operating system's reason; the run
then stops with one line that names the last good checkpoint and the command that resumes from
it (``last_good_checkpoint``, ``jobs.run.fit``). Only rank 0 writes; under DDP and FSDP the other
ranks learn of the failure from it (``stop_every_rank_on_write_error``) and stop with the same
error, instead of waiting for it at the next collective. torch reports a failed write as a ``RuntimeError``
from its zip writer ("unexpected pos ..."), with the ``OSError`` that says why only in its
context: ``_os_error`` digs it out.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""A write that fails for one of these (no space left, over quota, a read-only mount) is the
user's to fix, and the run resumes after it: it stops with one line, not a traceback."""


class OutputWriteError(RuntimeError):
    """A file of the run (a checkpoint, ``metrics.csv``, a rollout dump, ...) could not be written,
    for ``reason``; ``what`` names it. Whatever was written before is untouched.

    ``checkpoint`` / ``iteration``: the last good checkpoint of the run and the PPO iterations
    (optimizer steps, for the stages) it holds, filled in by ``jobs.run.fit`` (None: none written yet).
    """

    def __init__(self, what: str, reason: str):
        super().__init__(f"{reason} writing {what}")
        self.what, self.reason = what, reason
        self.checkpoint: Path | None = None
        self.iteration: int | None = None

    def __str__(self) -> str:
        what = super().__str__()
        if self.checkpoint is None:
            return f"{what}; no checkpoint of this run was written before it"
        return f"{what}; the last good checkpoint is {self.checkpoint} (after {self.iteration} iterations)"


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written; the file that was at its path is untouched."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"checkpoint {path}", reason)
        self.path = path


def full_disk_error(error: BaseException, output_dir: str | Path) -> OutputWriteError | None:
    """``error`` as an ``OutputWriteError`` when an ``OSError`` of ``FULL_DISK_ERRNOS`` caused it
    (a logger's or a dump's write, wherever it surfaced), naming its file when the OS did and the
    run's output directory otherwise (a failed ``write`` names no file); else None."""
    cause = _write_cause(error, FULL_DISK_ERRNOS)
    if cause is None:
        return None
    what = str(cause.filename) if cause.filename else f"the run's outputs under {output_dir}"
    return OutputWriteError(what, cause.strerror or os.strerror(cause.errno))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _os_error(error: BaseException) -> OSError | None:
    """The ``OSError`` that caused ``error``: itself, one in its cause / context chain, or one of
    the ranks' failures that torch.distributed.checkpoint gathers (``CheckpointException.failures``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        for failure in (getattr(error, "failures", None) or {}).values():
            failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
            cause = _os_error(failure) if isinstance(failure, BaseException) else None
            if cause is not None:
                return cause
        error = error.__cause__ or error.__context__
    return None


def _write_cause(error: BaseException, errnos: tuple[int, ...] | None = None) -> OSError | None:
    """The ``OSError`` behind a failed write (one of ``errnos``, when given); None for anything
    else: a bug, or a signal, which must go on as it is."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, though no signal

    if not isinstance(error, (Exception, CheckpointException)):
        return None
    cause = _os_error(error)
    return cause if cause is not None and (errnos is None or cause.errno in errnos) else None


def write_error(error: BaseException, path: Path) -> CheckpointWriteError | None:
    """``error`` as a ``CheckpointWriteError`` for ``path`` when an ``OSError`` caused it (a full
    disk, a quota, a read-only mount, ...); None for anything else (``_write_cause``)."""
    cause = _write_cause(error)
    return None if cause is None else CheckpointWriteError(path, cause.strerror or str(cause))


def replace_directory(new: Path, path: Path) -> None:
    """Put directory ``new`` at ``path``: the old one (a directory or a file) is renamed aside,
    ``new`` renamed in, then the old one removed. Between the two renames (microseconds) a kill
    leaves the old checkpoint at ``<path>.old``."""
    old = path.with_name(path.name + ".old")
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        protocol = get_filesystem(path).protocol
        if "file" not in (protocol if isinstance(protocol, tuple) else (protocol,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote: as Lightning does
        path = Path(path)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
            with os.fdopen(fd, "wb") as f:
                self._write(checkpoint, f)
            os.replace(tmp, path)
        except BaseException as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            error = write_error(e, path)
            if error is None:  # a bug, or a signal: as it is
                raise
            raise error from e

    @staticmethod
    def _write(checkpoint: dict[str, Any], f: IO[bytes]) -> None:
        """Serialise to the open temporary file and force it to disk before the rename."""
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = None):
        # weights_only=True unless a caller insists: a checkpoint is data, never code to run.
        return super().load_checkpoint(
            path, map_location=map_location, weights_only=True if weights_only is None else weights_only
        )


def stop_every_rank_on_write_error(strategy) -> None:
    """Make a failed checkpoint write stop every rank of ``strategy``, not only the one that writes.

    ``Trainer.save_checkpoint`` calls ``strategy.save_checkpoint`` on every rank (rank 0 writes,
    through ``AtomicCheckpointIO``) and then a barrier. Were rank 0 to raise straight away, the
    other ranks would wait in that barrier until they noticed rank 0's process was gone, and die
    with a traceback of their own. Wrapped here, every rank first agrees on whether the write
    failed (one boolean all-reduce per checkpoint), and all of them raise the same
    ``CheckpointWriteError`` (rank 0's path and reason, broadcast) before the barrier.
    ``strategy.save_checkpoint`` is Lightning's public hook; its collectives (FSDP's path
    broadcast) all come before rank 0's write, so none is left waiting.
    """
    save = strategy.save_checkpoint

    def save_checkpoint(checkpoint, filepath, storage_options=None):
        error = None
        try:
            save(checkpoint, filepath, storage_options=storage_options)
        except CheckpointWriteError as e:
            error = e
        if strategy.world_size > 1 and strategy.reduce_boolean_decision(error is not None, all=False):
            path, reason = strategy.broadcast((str(error.path), error.reason) if error is not None else None, src=0)
            raise error if error is not None else CheckpointWriteError(Path(path), reason)
        if error is not None:
            raise error

    strategy.save_checkpoint = save_checkpoint


SHARDED_META = "meta.pt"  # a sharded checkpoint's unsharded part (Lightning's name), beside DCP's .metadata


def is_sharded_checkpoint(path) -> bool:
    """A directory that ``trainer.strategy.save_distributed_checkpoint=true`` wrote: every rank's
    shards (torch.distributed.checkpoint, with its ``.metadata``) and ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / SHARDED_META).is_file() and (path / ".metadata").is_file()


def last_good_checkpoint(trainer) -> tuple[Path, int] | None:
    """The checkpoint a run stopped by a failed write resumes from, and its iteration count:
    ``last.ckpt`` (``preemption.last_checkpoint_path``; a directory when sharded), which every
    save rewrites last and which an interrupted write leaves as it was; None when it does not
    exist (or does not load)."""
    from ppo_lightning.parallel.preemption import last_checkpoint_path

    path = last_checkpoint_path(trainer)
    state_file = path / SHARDED_META if is_sharded_checkpoint(path) else path
    if not state_file.is_file():
        return None
    try:  # mmap: the tensors are not read, only the small pickle around them
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return path, int(state.get("global_step", 0))

"""Checkpoint writes that a kill cannot corrupt.

Lightning writes a checkpoint straight to its final path; a run killed mid-write leaves a
truncated ``last.ckpt`` and nothing to resume from. ``AtomicCheckpointIO`` writes to a temporary
file in the same directory, flushes it to disk, then renames it over the target: a reader (or a
resumed run) sees the old checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        protocol = get_filesystem(path).protocol
        if "file" not in (protocol if isinstance(protocol, tuple) else (protocol,)):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote: as Lightning does
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage,
                        weights_only: bool | None = None):
        # weights_only=True unless a caller insists: a checkpoint is data, never code to run.
        return super().load_checkpoint(path, map_location=map_location,
                                       weights_only=True if weights_only is None else weights_only)

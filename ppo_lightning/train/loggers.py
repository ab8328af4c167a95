"""Logger factories used by ``conf/logger/*.yaml``.

``wandb_logger`` never prompts and never hangs: it logs online only when a W&B API key is
configured and the W&B server answers within a few seconds; otherwise it writes an offline run
into the run directory, which ``wandb sync <run dir>/wandb/offline-run-*`` uploads later. And it
does not lose records in silence: W&B's own process writes the run's files, and on a full disk it
drops each record it cannot write and says so only in its ``debug-internal.log`` (an offline run
keeps nothing from then on), so the logger checks the free space under the run's W&B directory
after each log and stops the run as any failed write of the run does (``FreeSpaceCheckedWandbLogger``).
"""

from __future__ import annotations

import logging
import netrc
import os
import shutil
import socket
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from ppo_lightning.parallel.checkpoint import OutputWriteError

log = logging.getLogger(__name__)


def wandb_logged_in() -> bool:
    """A W&B API key in ``WANDB_API_KEY`` or in ``~/.netrc`` (where ``wandb login`` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        auth = netrc.netrc(os.environ.get("NETRC", os.path.expanduser("~/.netrc"))).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def _server_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_wandb_mode(mode: str = "auto") -> str:
    """online | offline | disabled. ``auto`` (and an unset ``WANDB_MODE``) picks online only
    when logged in and the server answers; ``WANDB_MODE`` in the environment wins over ``auto``."""
    if os.environ.get("WANDB_MODE", None) == "":
        del os.environ["WANDB_MODE"]  # wandb rejects an empty value at init
    if mode == "auto":
        env = os.environ.get("WANDB_MODE")
        if env in ("online", "offline", "disabled", "dryrun"):
            return "offline" if env == "dryrun" else env
        if wandb_logged_in() and _server_reachable():
            return "online"
        log.info("W&B: not logged in or server unreachable; logging offline (wandb sync uploads later)")
        return "offline"
    return mode


def finish_wandb(exit_code: int | None = None) -> None:
    """End the process's open W&B run, if any (one place for it): Lightning leaves runs open, a
    run closed only at interpreter exit may lose its last records, and the next job of a sweep
    would log into it. ``exit_code`` non-zero marks the run failed in W&B. Imports nothing when
    W&B was never imported."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)


def wandb_logger(
    project: str = "ppo_lightning", save_dir: str = ".", name: str | None = None, mode: str = "auto", **kwargs
):
    """A Lightning ``WandbLogger`` whose run lives under ``save_dir/wandb``, that stops the run
    when W&B's directory fills up (``FreeSpaceCheckedWandbLogger``)."""
    mode = resolve_wandb_mode(mode)
    os.makedirs(save_dir, exist_ok=True)
    # settings: no console capture (Lightning prints progress itself), no prompts
    import wandb

    finish_wandb()  # a run left open by an earlier job in this process: one run per job
    settings = wandb.Settings(console="off", silent=True)
    # mode goes straight to wandb.init: Lightning's offline=True would set WANDB_MODE for the
    # whole process, and wandb's settings singleton would otherwise keep the first run's mode.
    return FreeSpaceCheckedWandbLogger(
        project=project, save_dir=save_dir, name=name, mode=mode, settings=settings, **kwargs
    )


WANDB_MIN_FREE_BYTES = 1 << 20
"""Less free space than this under the run's W&B directory stops the run: W&B's records (a few
KiB each, in 32 KiB blocks of its transaction log) would no longer be written, and W&B would not
say so to this process."""


class FreeSpaceCheckedWandbLogger(WandbLogger):
    """``WandbLogger`` that checks, after each ``log_metrics``, that the file system of the run's
    W&B directory has ``WANDB_MIN_FREE_BYTES`` free, and otherwise raises ``OutputWriteError``
    (for a full disk: ``jobs.run.fit`` names the last good checkpoint, ``train.py`` prints one line
    with the command that resumes). A ``statvfs`` per log: microseconds."""

    @rank_zero_only  # as WandbLogger's: the other ranks hold no run
    def log_metrics(self, metrics, step=None) -> None:
        super().log_metrics(metrics, step)
        if self.experiment.settings.mode == "disabled":
            return
        directory = self.experiment.settings.sync_dir  # <save_dir>/wandb/<offline-run|run>-<id>
        free = shutil.disk_usage(directory).free
        if free < WANDB_MIN_FREE_BYTES:
            raise OutputWriteError(f"W&B's run files under {directory}", f"No space left on device ({free} bytes free)")

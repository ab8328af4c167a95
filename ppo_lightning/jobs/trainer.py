"""The Lightning Trainer of a run (``trainer``, ``logger`` and ``callbacks`` groups, checkpoints
written atomically), and what its precision costs on this CPU, said before the run starts."""

from __future__ import annotations

import logging

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.parallel.checkpoint import AtomicCheckpointIO, stop_every_rank_on_write_error

log = logging.getLogger(__name__)


def cpu_has_bf16_matmul() -> bool | None:
    """Whether this CPU multiplies bf16 matrices in hardware (x86: AVX512-BF16 or AMX); None where
    torch cannot tell (not x86). Without them torch still runs bf16 matmuls, on a slow path:
    about 60x slower than float32 on an AVX2 CPU (docs/benchmarks.md)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def warn_of_emulated_bf16(cfg: DictConfig) -> None:
    """bf16 on a CPU that has no bf16 matmul instructions is correct but many times slower than
    float32: say so before the run starts, naming the key."""
    t = cfg.trainer
    on_cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and str(t.precision).startswith("bf16") and cpu_has_bf16_matmul() is False:
        log.warning(
            "trainer.precision=%s on a CPU without bf16 matmul instructions (AVX512-BF16 or AMX; this one "
            "has %s): torch runs its bf16 matmuls on a slow path, tens of times slower than float32. "
            "Use trainer.precision=32-true on this machine.",
            t.precision,
            torch.backends.cpu.get_cpu_capability(),
        )


def instantiate_dict(group: DictConfig | None, key: str) -> list:
    """Instantiate every ``_target_`` entry of a named dict group (logger, callbacks)."""
    objs = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"{key}.{name}: expected a mapping with a _target_ (a class to build)")
        objs.append(hydra.utils.instantiate(node))
    return objs


def build_trainer(cfg: DictConfig, extra_callbacks: tuple | list = (), progress_bar: type | None = None) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` with the ``logger`` and ``callbacks`` groups, and
    ``progress_bar`` (a ``ProgressBar`` class: the PPO run's ``IterationProgressBar``) where the
    run shows one and the callbacks bring none; otherwise Lightning's own."""
    loggers = instantiate_dict(cfg.get("logger"), "logger")
    callbacks = [*instantiate_dict(cfg.get("callbacks"), "callbacks"), *extra_callbacks]
    if (
        progress_bar is not None
        and cfg.trainer.get("enable_progress_bar", True)
        and not any(isinstance(c, ProgressBar) for c in callbacks)
    ):
        callbacks.append(progress_bar())
    trainer = hydra.utils.instantiate(
        cfg.trainer, logger=loggers or False, callbacks=callbacks, plugins=[AtomicCheckpointIO()]
    )
    stop_every_rank_on_write_error(trainer.strategy)
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer

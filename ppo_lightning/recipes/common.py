"""What recipes share: building a small policy / reward model from generated data, and the
before/after table of the run's own evaluations."""

from __future__ import annotations

import json
import logging
from pathlib import Path
import lightning as L

from ppo_lightning.models.tiny import save_random_model

log = logging.getLogger(__name__)


def save_base_model(
    directory: Path,
    tokenizer,
    n_layer: int,
    n_head: int,
    n_embd: int,
    n_positions: int,
    seed: int = 0,
    arch: str = "gpt2",
) -> Path:
    """A random GPT-2 (or, ``arch="llama"``, a Llama: rotary positions, which copy by relative
    offset) sized to ``tokenizer``: the starting point of SFT and the reward model."""
    from transformers import GPT2Config, LlamaConfig

    if arch == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=n_embd,
            intermediate_size=4 * n_embd,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_head,
            max_position_embeddings=n_positions,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return save_random_model(directory, config, tokenizer, seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return save_random_model(directory, config, tokenizer, seed)


def fit_stage(
    stage: str,
    base_dir: Path,
    out_dir: Path,
    records: list[dict],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    max_length: int,
    seed: int,
    extra: dict | None = None,
) -> dict:
    """Train ``stage`` (sft | reward_model) from ``base_dir`` on in-memory ``records``; save it.
    ``extra``: more of the stage's ``task.*`` keys (``group_by_length`` only where the records'
    lengths do not tell what they teach apart: see its docstring)."""
    from ppo_lightning.config import OptimizerConfig
    from ppo_lightning.stages import STAGES

    _, build_fn, save_fn = STAGES[stage]
    model_cfg = {"name_or_path": str(base_dir)}
    optim_cfg = OptimizerConfig(lr=lr, scheduler="cosine", warmup_steps=max(1, steps // 20), min_lr_ratio=0.1)
    stage_cfg = {
        "max_length": max_length,
        "val_fraction": 0.1,
        "seed": seed,
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": 0,
        **(extra or {}),
    }
    L.seed_everything(seed, verbose=False)
    module, datamodule = build_fn(model_cfg, optim_cfg, stage_cfg, records=records)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=True,
        limit_val_batches=1.0,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=datamodule)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    save_fn(module, out_dir)
    metrics = dict(module.last_metrics)
    (out_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def eval_report(
    history,
    rows: dict[str, str],
    out_dir: Path | None,
    curve: dict[str, str] | None = None,
    n_samples: int = 3,
    extra_rows: dict[str, tuple[float, float]] | None = None,
) -> str:
    """The before/after table of a run's own evaluations (``PPOModule.eval_history``: the first,
    before training, and the last, after it), every eval point of ``curve``'s metrics, and samples.

    ``rows`` maps a row's label to its ``eval/*`` metric; ``extra_rows`` adds rows measured
    outside the run's evaluations, ``label: (before, after)``, below them. ``out_dir`` receives ``eval.json`` (the
    table and the curve) and, for ``curve`` (label -> metric), ``eval_curve.png`` beside
    ``metrics.csv`` (needs matplotlib, in the ``dev`` extra; without it the PNG is skipped with a
    warning)."""
    if len(history) < 2 or history[0].step != 0:
        return (
            f"no before/after table: it needs the evaluation before training and one after, and this process "
            f"made {len(history)} (at iterations {[p.step for p in history]}; a resumed run, or "
            "eval.before_training=false); the eval/* metrics of every evaluation are in the run's logs"
        )
    first, last = history[0], history[-1]
    before = {label: first.metrics[key] for label, key in rows.items()}
    after = {label: last.metrics[key] for label, key in rows.items()}
    extra_rows = extra_rows or {}
    for label, (b, a) in extra_rows.items():
        before[label], after[label] = b, a
    width = max(len(n) for n in before) + 2
    lines = [f"{'':{width}}{'before':>10}{'after':>10}"]
    lines += [f"{n:{width}}{before[n]:>10.3f}{after[n]:>10.3f}" for n in before]
    curve = curve or {}
    if curve:
        lines.append("\neval after iteration:" + "".join(f"{p.step:>7d}" for p in history))
        lines += [
            f"  {label:{width}}" + "".join(f"{p.metrics[key]:>7.3f}" for p in history) for label, key in curve.items()
        ]
    for label, point in (("before", first), ("after", last)):
        lines.append(f"\nsamples {label} RL:")
        lines += [f"  ...{p[-60:]!r} -> {r!r} (reward {x:.2f})" for p, r, x in point.samples[:n_samples]]
    if out_dir is not None:
        points = [{"step": p.step, **{label: p.metrics[key] for label, key in curve.items()}} for p in history]
        (out_dir / "eval.json").write_text(json.dumps({"before": before, "after": after, "curve": points}, indent=2))
        if curve:
            plot_curve(points, list(curve), out_dir / "eval_curve.png")
    return "\n".join(lines)


def plot_curve(points: list[dict], labels: list[str], path: Path) -> Path | None:
    """``labels`` of ``points`` against ``step``, one line each, as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed, so %s is not drawn: pip install matplotlib", path)
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = [p["step"] for p in points]
    for label in labels:
        ax.plot(steps, [p[label] for p in points], marker="o", label=label)
    ax.set_xlabel("PPO iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

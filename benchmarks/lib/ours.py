"""ppo_lightning's side of the benchmarks: a workload as a real run (``train.py``'s config composed
by Hydra, the reward-model path or GRPO's reward function, a Lightning Trainer), timed; and our
sampler against Hugging Face's ``model.generate`` on one rollout batch."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import lightning as L
import torch

from benchmarks.lib.grpo_workload import ADAM_EPS, BETA, LR, REWARD_FN
from benchmarks.lib.measure import timed
from benchmarks.lib.runner import ROOT, alternate
from benchmarks.lib.workloads import Workload, build_models, render_prompts, tokenizer_overrides, write_prompts


class PerfTotals(L.Callback):
    """Sums the module's per-iteration rollout / update timers; checks that every rollout ran to
    ``response_tokens`` (when given), the fixed length the workload's numbers assume."""

    def __init__(self, response_tokens: int | None = None):
        self.response_tokens = response_tokens
        self.rollout_s = 0.0
        self.update_s = 0.0
        self.iterations = 0
        self.per_iteration: list[dict[str, float]] = []  # every metric of each iteration

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = pl_module.last_metrics
        if self.response_tokens is not None and m["rollout/response_length"] != self.response_tokens:
            raise RuntimeError(
                f"a rollout stopped early: mean response length "
                f"{m['rollout/response_length']}, expected {self.response_tokens}"
            )
        self.rollout_s += float(m["perf/time_rollout_s"])
        self.update_s += float(m["perf/time_update_s"])
        self.iterations += 1
        self.per_iteration.append(dict(m))


def mean_response_tokens(w: Workload, totals: PerfTotals) -> float:
    """The mean completion length of the run: ``response_tokens``, or for a workload whose
    completions stop at EOS, the iterations' mean ``rollout/response_length``."""
    if not w.stops_at_eos:
        return w.response_tokens
    return sum(float(m["rollout/response_length"]) for m in totals.per_iteration) / len(totals.per_iteration)


def workload_overrides(
    w: Workload,
    policy_dir: Path,
    reward_dir: Path,
    prompts_file: Path,
    out_dir: Path,
    extra: Sequence[str] = (),
    reward: Sequence[str] | None = None,
) -> list[str]:
    """The ``train.py`` overrides of the workload's PPO run; ``extra`` overrides come last (a key
    given again replaces the earlier value); ``reward``: the reward's overrides instead of the
    workload's reward model (``reward=model`` on ``reward_dir``)."""
    if reward is None:
        reward = ("reward=model", f"reward.name_or_path={reward_dir}", f"reward.batch_size={w.rollout_batch}")
    overrides = [
        f"model.name_or_path={policy_dir}",
        "model.build_tiny=null",
        *reward,
        "data=file",
        f"data.path={prompts_file}",
        f"data.batch_size={w.rollout_batch}",
        f"data.max_prompt_length={w.prompt_tokens}",
        f"ppo.minibatch_size={w.minibatch_size}",
        f"ppo.ppo_epochs={w.ppo_epochs}",
        f"sampling.max_new_tokens={w.response_tokens}",
        f"sampling.stop_at_eos={str(w.stops_at_eos).lower()}",  # else full length: EOS an ordinary token
        f"trainer.max_steps={w.iterations}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.enable_checkpointing=false",
        "logger=none",
        "callbacks=none",
        "export_dir=null",
        "reward.normalize=false",  # TRL scores raw (PPOTrainer and GRPOTrainer): the same work on both sides
        f"paths.output_dir={out_dir}",
        f"paths.cache_dir={out_dir}",
        *tokenizer_overrides(w, policy_dir),
        *extra,
    ]
    return overrides


def compose(
    w: Workload,
    policy_dir: Path,
    reward_dir: Path,
    prompts_file: Path,
    out_dir: Path,
    extra: Sequence[str] = (),
    reward: Sequence[str] | None = None,
):
    """``train.py``'s config for the workload's PPO run, composed by Hydra (``workload_overrides``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import ppo_lightning.config  # noqa: F401

    overrides = workload_overrides(w, policy_dir, reward_dir, prompts_file, out_dir, extra, reward)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def grpo_overrides(prompts: int, generations: int) -> list[str]:
    """The overrides that turn the workload's PPO run into the GRPO run TRL's ``GRPOTrainer`` is
    set beside (``trl_grpo``): P prompts x G completions, group-normalised scores,
    the k3 KL in the loss, GRPO's loss aggregation (each response's token mean, then the mean over
    responses: TRL's ``loss_type="grpo"``), one pass over one minibatch of every row."""
    return [
        "ppo.advantage=grpo",
        f"ppo.num_generations={generations}",
        "ppo.kl_in=loss",
        "ppo.kl_estimator=k3",
        f"ppo.kl_coef={BETA}",
        "ppo.loss_agg=seq_mean_token_mean",
        f"data.batch_size={prompts}",
        f"ppo.minibatch_size={prompts * generations}",
        "ppo.ppo_epochs=1",
        f"optimizer.lr={LR}",
        f"optimizer.eps={ADAM_EPS}",
        "optimizer.scheduler=constant",
    ]


def grpo_reward() -> list[str]:
    """The function reward both sides call (``grpo_workload.char_fraction_reward``)."""
    return ["reward=function", f"reward.fn={REWARD_FN}"]


def backend_available(backend: str) -> None:
    """Stop with "generation=<backend> not available" when the config group has no such option."""
    if not (ROOT / "conf" / "generation" / f"{backend}.yaml").is_file():
        sys.exit(f"generation={backend} not available: no conf/generation/{backend}.yaml")


def run_ppo(
    w: Workload,
    model_root: Path,
    out_dir: Path,
    trainer_kind: str = "ppo",
    prompts: int | None = None,
    generations: int | None = None,
    iterations: int | None = None,
    backend: str = "hf",
    callbacks: Sequence[L.Callback] = (),
    overrides: Sequence[str] = (),
) -> dict:
    """One timed ``trainer.fit`` of the workload: PPO (``trainer_kind="ppo"``, the workload's
    shape) or GRPO (``"grpo"``, ``prompts`` x ``generations`` completions per iteration).
    ``callbacks`` join the Trainer's after the timers (``benchmarks.profile_iteration`` profiles
    one iteration with one); ``overrides`` (Hydra's, e.g. ``trainer.precision=bf16-mixed``) go
    last."""
    from ppo_lightning.jobs.factory import build

    iterations = iterations or w.iterations
    policy_dir, reward_dir = build_models(w, model_root)
    prompts_file = write_prompts(w, out_dir)
    extra = [] if iterations == w.iterations else [f"trainer.max_steps={iterations}"]  # compose sets the workload's
    reward, rows = None, w.rollout_batch
    if trainer_kind == "grpo":
        extra += grpo_overrides(prompts, generations)
        reward, rows = grpo_reward(), prompts * generations
    if backend != "hf":
        backend_available(backend)
        extra.append(f"generation={backend}")
    extra += overrides
    try:
        cfg = compose(w, policy_dir, reward_dir, prompts_file, out_dir, extra=tuple(extra), reward=reward)
        module, datamodule, trainer = build(cfg)
    except Exception as e:
        if backend == "hf":
            raise
        sys.exit(f"generation={backend} not available: {type(e).__name__}: {e}")
    totals = PerfTotals(None if w.stops_at_eos else w.response_tokens)
    trainer.callbacks.append(totals)
    trainer.callbacks.extend(callbacks)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    total = time.perf_counter() - t0
    assert totals.iterations == iterations, (totals.iterations, iterations)
    episodes = iterations * rows
    assert module.episode == episodes, (module.episode, episodes)
    result = {
        "episodes": episodes,
        "episodes_per_s": episodes / total,
        "generated_tokens_per_s": episodes * mean_response_tokens(w, totals) / total,
        "rollout_s": totals.rollout_s,
        "update_s": totals.update_s,
        "total_s": total,
    }
    if trainer_kind == "grpo":
        result = {
            "trainer": "grpo",
            "backend": backend,
            "prompts": prompts,
            "generations": generations,
            "iterations": iterations,
            "completions_per_s": episodes / total,
            **result,
        }
    elif backend != "hf":
        result["backend"] = backend
    return result


def compare_generate(w: Workload, model_root: Path, repeats: int, device: str = "cpu", bf16: bool = False) -> dict:
    """Our sampler vs bare HF ``generate`` on one rollout batch, alternated ``repeats`` times, on
    ``device``; ``bf16``: both under bf16 autocast (the rollout's numerics in ``bf16-mixed``)."""
    import contextlib

    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer
    from ppo_lightning.generation.hf import generate

    dev = torch.device(device)
    policy_dir, _ = build_models(w, model_root)
    tok = load_tokenizer(str(policy_dir))
    lm = load_causal_lm(str(policy_dir), tok).eval().to(dev)
    enc = tok(render_prompts(w, tok)[: w.rollout_batch], return_tensors="pt", padding=True).to(dev)
    n_tokens = w.rollout_batch * w.response_tokens
    g = torch.Generator(device=dev).manual_seed(0)

    def numerics():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def ours():
        with numerics():
            resp, _ = generate(
                lm,
                enc.input_ids,
                enc.attention_mask,
                max_new_tokens=w.response_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                stop_at_eos=False,
                generator=g,
            )
        assert resp.shape[1] == w.response_tokens

    def hf():
        with torch.no_grad(), numerics():
            out = lm.generate(
                input_ids=enc.input_ids,
                attention_mask=enc.attention_mask,
                do_sample=True,
                use_cache=True,
                max_new_tokens=w.response_tokens,
                min_new_tokens=w.response_tokens,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=tok.pad_token_id,
            )
        assert out.shape[1] == enc.input_ids.shape[1] + w.response_tokens

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(2):  # warm-up: the first calls pay for kernel selection and allocation
        ours(), hf()
    times = alternate({"ours": lambda r: timed(ours, sync)[1], "hf": lambda r: timed(hf, sync)[1]}, repeats)
    ours_tps = n_tokens / statistics.median(times["ours"])
    hf_tps = n_tokens / statistics.median(times["hf"])
    return {
        "generate_tokens_per_s_ours": ours_tps,
        "generate_tokens_per_s_hf": hf_tps,
        "generate_ratio_ours_over_hf": ours_tps / hf_tps,
    }

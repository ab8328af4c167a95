"""``PPOModule``: the Lightning adapter of the PPO loop (``algorithm.PPO``), one iteration per batch.

1. ``on_train_batch_start``: ``algo.collect(batch)``, this iteration's ``Rollout``.
2. ``training_step``: ``algo.learn(rollout, optimizer)`` (manual optimisation), then the end of the
   iteration: Lightning's step counter and the scheduler, the KL controller, the run's counters,
   and the iteration's metrics (``metrics.py``).

The algorithm is ``algo.algorithm.PPO``, its episodes a ``rollouts.RolloutWorker``'s; ranks and
precision are ``parallel.distributed``'s. This module adds what Lightning owns:
hooks, the optimizer and scheduler, FSDP2 sharding, checkpoints. Lightning's ``global_step``
counts PPO iterations (not the optimizer steps inside one), so ``trainer.max_steps``,
checkpoint intervals and logger steps all speak in iterations.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import lightning as L
import torch
from torch import Tensor, nn

from ppo_lightning.train import metrics, normalization
from ppo_lightning.train.evaluation import EvalPoint, Evaluation, log_sample_table
from ppo_lightning.train.normalization import NormalizedReward
from ppo_lightning.algo.algorithm import PPO
from ppo_lightning.algo.rollout import Rollout, normalized
from ppo_lightning.config import OptimizerConfig, PPOConfig
from ppo_lightning.parallel.distributed import Runtime
from ppo_lightning.train.dumps import episode_rows, write_rollout
from ppo_lightning.generation import BackendFactory, SamplingParams, default_backend
from ppo_lightning.generation.lagged import LaggedBackend
from ppo_lightning.parallel.lightning_compat import count_iteration
from ppo_lightning.train.optim import configure_optimizers
from ppo_lightning.models.policy import PolicyWithValueHead
from ppo_lightning.rollouts import RolloutWorker
from ppo_lightning.parallel.sharding import FSDP2Strategy, initialize_root, shard_module
from ppo_lightning.models.weights import is_sharded, tied_aliases

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many PPO iterations in a row produced non-finite rewards, losses or gradients."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """How a ``PPOModule`` samples, as one object: ``backend``, the generation backend's factory
    (the ``generation`` config group; None: ``hf``), called once for the policy and once for the
    reference; ``sampling``, how every caller samples (the ``sampling.*`` node; None:
    ``SamplingParams``' defaults, 32 new tokens); ``runner``, how each record is played: an
    ``envs.EpisodeRunner`` (``env``: every rollout, reference sample and evaluation plays
    multi-turn episodes), or None, the null environment (``envs.SingleTurn``: one response)."""

    backend: BackendFactory | None = None
    sampling: SamplingParams | None = None
    runner: object = None
    staleness: int = 0  # rollout.staleness: the policy's backend lags this many updates behind

    def backends(self, policy_lm: nn.Module, ref_lm: nn.Module, tokenizer):
        """``(rollout, live, reference)`` backends: the rollout's samples the policy (with
        ``staleness``, a copy ``staleness`` updates behind it: ``generation.lagged``); ``live``
        samples the policy as it is now (evaluation); the reference's samples ``ref_lm``, through
        the ``hf`` backend where the policy's is an engine with weights of its own."""
        make = self.backend or default_backend()
        live = make(policy_lm, tokenizer)
        rollout = LaggedBackend(make, policy_lm, tokenizer, self.staleness) if self.staleness else live
        return rollout, live, (make if live.samples_live_module else default_backend())(ref_lm, tokenizer)


class PPOModule(L.LightningModule):
    """PPO on a causal LM with a value head, against a frozen reference and a reward scorer.

    ``policy``: trained; ``ref_lm``: the frozen reference (KL anchor); ``reward``: the scorer
    ``(prompts, responses) -> raw scores`` with its normalisation (``normalization.NormalizedReward``:
    a fixed ``(gain, bias)``, or fitted on reference samples when the run starts);
    ``ppo_cfg`` / ``optim_cfg``: ``PPOConfig`` / ``OptimizerConfig``. ``generation``: the backend,
    the sampling parameters and the episodes (``Generation``): with the reward and the tokenizer
    they make the algorithm's ``worker``; the backend's factory also makes the reference's
    ``ref_backend`` (the ``hf`` backend when the policy's is an engine with weights of its own). ``evaluation``: ``evaluation.Evaluation`` (``eval.*``;
    None: never). ``rollout_dir``: where ``ppo.rollout_dump`` writes each iteration's episodes.
    """

    def __init__(
        self,
        policy: PolicyWithValueHead,
        ref_lm: nn.Module,
        reward: NormalizedReward,
        tokenizer,
        ppo_cfg: PPOConfig,
        optim_cfg: OptimizerConfig,
        seed: int = 0,
        generation: Generation = Generation(),
        evaluation: Evaluation | None = None,
        rollout_dir: str | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # frozen weights are not checkpointed (see checkpointed)
        # the trained and frozen modules are registered here, where Lightning moves, shards and
        # checkpoints them; the algorithm and its worker use the same objects
        self.policy, self.ref_lm, self.reward_fn = policy, ref_lm, reward.fn
        self.ppo_cfg, self.optim_cfg, self.seed = ppo_cfg, optim_cfg, seed
        backend, self.live_backend, self.ref_backend = generation.backends(policy.lm, ref_lm, tokenizer)
        sampling = generation.sampling or SamplingParams(max_new_tokens=32)
        worker = RolloutWorker(backend, sampling, reward.fn, tokenizer, generation.runner)
        self.runtime = Runtime(self)
        self.algo = PPO(policy, ref_lm, worker, ppo_cfg, self.runtime)
        self.rollout_dir = rollout_dir  # ppo.rollout_dump's directory (the run's rollouts/)
        self.algo.reward_norm = reward.norm
        self.reward_normalization = reward  # what normalization.fit reads: the fit's settings
        self.episode = 0  # episodes (sampled responses) so far, summed over ranks
        self.skipped_updates = 0  # updates skipped for a non-finite loss or gradient
        self.nonfinite_streak = 0  # consecutive iterations with a skip
        self.evaluation = evaluation or Evaluation()  # evaluates only when the data has eval prompts
        self._eval_due: dict[str, float] = {}  # this iteration's, from on_train_batch_start to training_step
        self.rollout: Rollout | None = None  # this iteration's, from on_train_batch_start to training_step
        self.last_metrics: dict[str, float] = {}  # every metric of the last iteration
        self._callback_metrics: tuple[str, ...] = ()  # set in on_fit_start
        self._unsaved_policy_keys: frozenset[str] | None = None  # see checkpointed
        self._warned: set[str] = set()  # _warn_of_empty_iteration's, once per run

    @property
    def eval_history(self) -> list[EvalPoint]:
        """Every evaluation of this process, in order (the recipes' tables)."""
        return self.evaluation.history

    @property
    def reward_norm(self) -> tuple[float, float] | None:
        return self.algo.reward_norm

    @property
    def worker(self) -> RolloutWorker:
        """The algorithm's rollout worker: the policy's backend, the sampling, the environment and
        the reward (evaluation plays through it too)."""
        return self.algo.worker

    tokenizer = property(lambda self: self.algo.worker.tokenizer, doc="The worker's tokenizer.")
    sampling = property(lambda self: self.algo.worker.params, doc="How the worker samples (SamplingParams).")

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> Tensor:
        """The training reward of texts: the reward's raw scores through the run's normalisation."""
        return normalized(torch.as_tensor(self.reward_fn(prompts, responses), dtype=torch.float32), self.reward_norm)

    # ------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """Under ``FSDP2Strategy`` (``trainer=fsdp``, ``fsdp_cpu``): shard the policy and the
        reference over the data-parallel mesh (``sharding.shard_module``). Other strategies: nothing."""
        if isinstance(self.trainer.strategy, FSDP2Strategy):
            shard_module(self, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return configure_optimizers(self, [p for p in self.policy.parameters() if p.requires_grad], self.optim_cfg)

    def on_fit_start(self) -> None:
        # A resumed run restored every rank's generator from the checkpoint (before this hook, or
        # after it under sharded strategies, which then replace this one).
        if self.algo.generator is None:
            self.algo.generator = self.runtime.new_generator(self.seed)
        self.ref_lm.eval()
        if is_sharded(self.policy):
            initialize_root(self.policy, self.device)
        self.runtime.setup()
        self._callback_metrics = metrics.callback_metrics(self.trainer)

    # ------------------------------------------------------------------------- part 1: collect
    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        if self.reward_norm is None:  # once per run: a resumed run restored it from the checkpoint
            # (here, not in on_fit_start: sharded strategies restore checkpoints after on_fit_start)
            self._fit_reward_normalization()
        if self._evaluates_at(self.global_step):  # the policy before this iteration's update
            self._eval_due = self._evaluate()
        self.rollout = self.algo.collect(batch, policy_version=self.global_step)

    def _fit_reward_normalization(self) -> None:
        """Fix ``reward_norm`` from the reference's episodes (``normalization.fit_for_run``)."""
        self.algo.reward_norm = normalization.fit_for_run(
            self.reward_normalization,
            self.worker.replace(backend=self.ref_backend),
            self.ref_lm,
            self.policy,
            self.trainer.datamodule,
            self.runtime,
            self.seed,
            self.trainer.world_size,
            self.device,
        )

    # ------------------------------------------------------------------------- part 2: learn
    def training_step(self, batch: dict, batch_idx: int) -> None:
        r, t0 = self.rollout, time.perf_counter()
        lr, kl_coef = self.lr_schedulers().get_last_lr()[0], self.algo.kl_ctl.value  # what this iteration uses
        learned = self.algo.learn(r, self.optimizers())
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # count queued kernels in the timers
        m = metrics.iteration_metrics(
            r,
            learned.stats,
            num_generations=self.ppo_cfg.num_generations,
            has_critic=self.policy.v_head is not None,
            time_rollout=r.collect_time_s,
            time_update=time.perf_counter() - t0,
            runtime=self.runtime,
            mask_truncated=self.ppo_cfg.mask_truncated_completions and self.sampling.stop_at_eos,
            engine_cap=self.ppo_cfg.engine_correction_cap,
        )
        count_iteration(self.optimizers())
        self.lr_schedulers().step()
        rows = r.batch_size * self.trainer.world_size
        sync_s = self.algo.end_iteration(m["objective/kl"], rows)
        if sync_s is not None:
            m["perf/time_weight_sync_s"] = sync_s
        self.episode += rows
        self.skipped_updates += learned.skipped
        self.nonfinite_streak = self.nonfinite_streak + 1 if learned.skipped else 0
        if learned.skipped:
            log.warning(
                "PPO iteration %d: skipped %d update(s) with non-finite %s; weights untouched",
                self.global_step - 1,
                learned.skipped,
                learned.nonfinite,
            )
        m.update(
            {
                "objective/kl_coef": kl_coef,
                "lr": lr,
                "episode": float(self.episode),
                "health/skipped_updates": float(self.skipped_updates),
            }
        )
        m.update(self._eval_due)
        self._eval_due = {}
        metrics.warn_of_empty_iteration(m, rows, self.global_step - 1, self._warned)
        self.last_metrics = m
        metrics.log_metrics(self, m, self._callback_metrics, r.batch_size)
        if self.ppo_cfg.rollout_dump and self.rollout_dir:
            rows = episode_rows(r, self.tokenizer)
            write_rollout(self.rollout_dir, self.global_step - 1, rows, self.global_rank, self.trainer.world_size)
        if self.nonfinite_streak >= self.ppo_cfg.max_nonfinite_iterations:
            raise NonFiniteError(
                f"{self.nonfinite_streak} PPO iterations in a row had non-finite values (last: {learned.nonfinite}); "
                f"stopping (ppo.max_nonfinite_iterations={self.ppo_cfg.max_nonfinite_iterations}). Checkpoints "
                "written so far are intact. Check the reward function, or lower optimizer.lr."
            )

    def on_train_end(self) -> None:
        if self.global_step >= self.trainer.max_steps and self._evaluates_at(None):  # a run stopped early: none
            m = self._evaluate()
            for lg in self.loggers:
                lg.log_metrics(m, step=self.global_step)
                lg.save()

    def teardown(self, stage: str) -> None:
        """The fit is over (finished, stopped or failed): an engine backend frees its engine, and
        the environments kept for reuse are closed (``env.reuse_instances``)."""
        self.algo.worker.close()

    def _evaluate(self) -> dict[str, float]:
        """The ``eval/*`` metrics of the policy as it is now (``evaluation.Evaluation``); rank 0's
        first samples go to a W&B logger as a table."""
        point = self.evaluation(
            self.global_step,
            self.worker.replace(backend=self.live_backend),
            self.policy,
            self.ref_lm,
            self.runtime,
            self.trainer.datamodule,
            device=self.device,
            seed=self.seed,
            head_chunk=self.ppo_cfg.lm_head_chunk_size,
        )
        log_sample_table(self.loggers, self.global_step, point.samples)
        return point.metrics

    def _evaluates_at(self, step: int | None) -> bool:
        return self.evaluation.due(self.trainer.datamodule, step)

    # ------------------------------------------------------------------------- checkpoints
    def checkpointed(self, key: str) -> bool:
        """Whether a state-dict entry is saved in checkpoints. Frozen weights are not: the reference
        and reward model, and with LoRA the policy's base weights; each is rebuilt from its source
        (``model.name_or_path``, ``ref.*``, ``reward.*``) when a run resumes or exports. Nor is the
        second name of a tied weight (GPT-2's ``lm_head.weight`` is its token embedding): loading
        the first sets both, and a gathered (FSDP) state dict would hold it as a second copy."""
        if key.startswith(("ref_lm.", "reward_fn.")):
            return False
        if self._unsaved_policy_keys is None:
            frozen = {
                k
                for k, v in self.policy.state_dict(keep_vars=True).items()
                if isinstance(v, nn.Parameter) and not v.requires_grad
            }
            self._unsaved_policy_keys = frozenset(f"policy.{k}" for k in frozen | tied_aliases(self.policy))
        return key not in self._unsaved_policy_keys

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        sd = checkpoint["state_dict"]
        for k in [k for k in sd if not self.checkpointed(k)]:
            del sd[k]
        counters = {"episode": self.episode, "skipped_updates": self.skipped_updates}
        checkpoint["ppo_state"] = {**self.algo.state_dict(), **counters, "nonfinite_streak": self.nonfinite_streak}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("ppo_state", {})
        self.episode = int(state.get("episode", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        streams = self.algo.load_state_dict(state, self.seed, int(checkpoint.get("global_step", 0)))
        if streams is not None and not streams[1] and self.global_rank == 0:
            log.warning(
                "the checkpoint holds the sampling streams of %d rank(s); this run has %d, so each rank "
                "starts a new stream (the trajectory differs from an uninterrupted run)",
                streams[0],
                self.trainer.world_size,
            )

"""A sampler that lags the policy by ``rollout.staleness`` updates: the rollout iteration ``i``
learns from is sampled by the policy after update ``i - K``.

``LaggedBackend`` keeps its own copy of the policy's LM and, after each iteration's update
(``sync_weights``), a snapshot of the weights the update trains; the copy takes a snapshot once
it is ``K`` versions old, so iteration ``i`` samples version ``max(0, i - K)``. The copy samples
through an inner backend (``hf``, asked for its own logprobs: the behaviour policy's, which the
update's correction divides by) and tags each token with the version it holds
(``weights_version``). Only the weights that train are snapshotted (LoRA: the adapters), and the
copy, its version and the snapshots waiting their turn are checkpointed (``state_dict``), so a
resumed run samples what the uninterrupted one would have.

This is the asynchronous worker's arithmetic without its overlap: the same rollouts, from the
same versions, in one process (docs/async.md).
"""

from __future__ import annotations

import collections
import time

import torch
from torch import Tensor, nn

from ppo_lightning.generation import BackendFactory, Generated, GenerationBackend, SamplingParams
from ppo_lightning.models.policy import make_reference


def weights_of(lm: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """A copy of ``lm``'s parameters ``names``."""
    return {name: lm.get_parameter(name).detach().clone() for name in names}


class LaggedBackend(GenerationBackend):
    """Samples a copy of ``lm`` (the live policy LM) that is ``staleness`` updates behind it,
    through ``make(copy, tokenizer, logprobs=True)``. ``version``: the policy version the copy
    holds (the number of updates in it); ``live_version``: the live policy's."""

    samples_live_module = False

    def __init__(self, make: BackendFactory, lm: nn.Module, tokenizer, staleness: int):
        if staleness < 1:
            raise ValueError(f"staleness={staleness}: a lagging sampler lags by at least one update")
        self.live, self.staleness = lm, staleness
        self.lm = make_reference(lm)  # the sampler's own weights: a frozen copy, the value-head hook dropped
        self.names = [name for name, p in lm.named_parameters() if p.requires_grad]  # what updates change
        self.inner = make(self.lm, tokenizer, logprobs=True)
        self.min_p_first = self.inner.min_p_first
        self.version = self.live_version = 0
        self.pending: collections.deque[tuple[int, dict[str, Tensor]]] = collections.deque()

    def generate(self, prompt_ids: Tensor, attention_mask: Tensor, params: SamplingParams, generator=None) -> Generated:
        """The copy's samples with its own logprobs of them (the behaviour policy's)."""
        self._follow_device()
        out = self.inner.generate(prompt_ids, attention_mask, params, generator)
        if out.logprobs is None:
            raise RuntimeError(f"{type(self.inner).__name__} returned no logprobs; a lagging sampler needs them")
        return out

    def weights_version(self, policy_version: int) -> int:
        return self.version

    def sync_weights(self) -> float:
        """After an update: snapshot the live weights as version ``live_version + 1``, and load into
        the copy every snapshot that is now ``staleness`` versions old. The seconds it took."""
        t0 = time.perf_counter()
        self.live_version += 1
        self.pending.append((self.live_version, weights_of(self.live, self.names)))
        while self.pending and self.pending[0][0] <= self.live_version - self.staleness:
            self.version, weights = self.pending.popleft()
            self._load(weights)
        self.inner.sync_weights()
        return time.perf_counter() - t0

    def _load(self, weights: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name in self.names:
                self.lm.get_parameter(name).copy_(weights[name])

    def _follow_device(self) -> None:
        """The copy on the live LM's device (Lightning moves the modules it holds, not this copy)."""
        device = next(self.live.parameters()).device
        if next(self.lm.parameters()).device != device:
            self.lm.to(device)

    def state_dict(self) -> dict:
        """The copy's trained weights, its version, the live version and the snapshots waiting."""
        return {
            "version": self.version,
            "live_version": self.live_version,
            "weights": weights_of(self.lm, self.names),
            "pending": list(self.pending),
        }

    def load_state_dict(self, state: dict) -> None:
        self.version, self.live_version = int(state["version"]), int(state["live_version"])
        self._load(state["weights"])
        self.pending = collections.deque((int(v), w) for v, w in state["pending"])

    def close(self) -> None:
        self.inner.close()

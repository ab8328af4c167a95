"""Sampling behind one interface: ``SamplingParams`` says how, a backend says with what.

Every caller that samples (the rollout, reward normalisation's reference samples, the recipes'
evaluations and data builds) passes a ``SamplingParams`` to a backend's ``generate``; none
passes sampling arguments of its own. A backend is chosen by the ``generation`` config group
(``_target_``, instantiated as a partial and called with the LM to sample and its tokenizer):

- ``hf`` (``hf.HFBackend``, the default): samples the live module with a KV cache.
- ``vllm`` (``vllm.VLLMBackend``): a colocated vLLM engine with its own copy of the policy's
  weights, which receives the new ones through ``sync_weights`` after each iteration's updates.

Old logprobs never come from a backend: they are the training forward's, so the first update's
ratio is exactly 1 whatever the backend's numerics. A backend's own logprobs of its samples
(``Generated.logprobs``: vLLM's always, ``hf``'s with ``generation.logprobs=true``) measure how
far its numerics are from the trainer's (``rollout/engine_*``) and feed ``ppo.engine_correction``.

The reference is sampled (reward normalisation's samples, once per run) by the ``hf`` backend
whatever the group says: an engine holds one model's weights, the policy's.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ppo_lightning.generation.params import SamplingParams
from ppo_lightning.generation.stops import StopChecker


class Generated(NamedTuple):
    """What ``generate`` returns: ``responses [B, R]`` (pad after each row's stop, ``R <=
    params.max_new_tokens``), ``response_mask [B, R]`` (1 up to and including the stop), and the
    backend's own ``logprobs [B, R]`` of the sampled tokens under the distribution it drew them
    from (0 after each stop): vLLM's always, the ``hf`` sampler's with ``generation.logprobs``,
    else None."""

    responses: Tensor
    response_mask: Tensor
    logprobs: Tensor | None = None


class GenerationBackend:
    """The protocol every backend implements, with the defaults of a backend that samples the live
    module. A caller reads nothing off a backend but what is declared here."""

    samples_live_module: bool = True
    """True: ``generate`` runs the module it was given (``hf``); False: an engine's copy of its
    weights, which ``sync_weights`` refreshes (``vllm``)."""

    min_p_first: bool = False
    """Whether the backend applies min-p before top-k and top-p (vLLM's sampler), so that the
    trainer's view of the truncated distribution (``rollouts.engine.truncated_logprobs``)
    follows the same order."""

    @staticmethod
    def preflight() -> None:
        """Checks that need no model (the engine's package imports): ``jobs.factory`` runs them
        before any model loads. Nothing by default."""

    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generated:
        """The responses to left-padded ``prompt_ids [B, P]`` as ``params`` say (``Generated``)."""
        raise NotImplementedError

    def weights_version(self, policy_version: int) -> int:
        """The policy version whose weights ``generate`` samples, when the policy is at
        ``policy_version`` (its iteration): that one, unless the backend lags behind it
        (``lagged.LaggedBackend``)."""
        return policy_version

    def state_dict(self) -> dict:
        """What a checkpoint must hold for the backend to sample as an uninterrupted run would:
        nothing, unless it keeps weights of its own that the policy's do not restore."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s entries."""

    def sync_weights(self) -> float | None:
        """Take the policy's new weights after an iteration's updates: the seconds it took, or
        None when there was nothing to take (the backend samples the live module, or its engine
        has not started)."""
        return None

    def close(self) -> None:
        """Free what the backend holds of its own (an engine); the next ``generate`` starts over.
        Called when a fit ends."""


BackendFactory = Callable[..., GenerationBackend]  # (lm, tokenizer, fast_decode=...) -> backend


def stopped_rows(responses: Tensor, response_mask: Tensor, params: SamplingParams, tokenizer) -> Tensor:
    """``[B]`` bool: the response holds a stop (EOS or a stop token among its tokens, or, with
    ``stop_at_eos``, a stop string completed by its last token), so it ended on its own rather
    than at ``max_new_tokens``."""
    ids = torch.tensor([tokenizer.eos_token_id, *params.stop_token_ids], device=responses.device)
    hit = (torch.isin(responses, ids) & (response_mask > 0)).any(1)
    if params.stop_strings and params.stop_at_eos:
        checker = StopChecker(tokenizer.eos_token_id, params.stop_token_ids, params.stop_strings, tokenizer)
        rows = [r[: int(n)] for r, n in zip(responses.tolist(), response_mask.sum(1).tolist())]
        hit = hit | torch.tensor([checker.ends_at(r) for r in rows], device=responses.device)
    return hit


def default_backend() -> BackendFactory:
    from ppo_lightning.generation.hf import HFBackend

    return HFBackend


__all__ = [
    "BackendFactory",
    "Generated",
    "GenerationBackend",
    "SamplingParams",
    "StopChecker",
    "default_backend",
    "stopped_rows",
]

"""Named benchmark workloads, shared by every benchmark script so that they measure the same thing.

A workload fixes the policy and reward-model size, the prompt set and the PPO shape. Models are
random-initialised GPT-2s over the byte vocabulary (256 bytes + EOS + pad), written to disk with
``save_pretrained`` and loaded back through the ordinary ``from_pretrained`` path.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from ppo_lightning.tiny import save_tiny_causal_lm, save_tiny_reward_model


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    num_prompts: int  # size of the prompt set
    prompt_tokens: int  # every prompt is exactly this many byte tokens
    response_tokens: int  # responses run to this length, no early stop at EOS
    rollout_batch: int  # prompts per PPO iteration
    ppo_epochs: int
    num_minibatches: int
    episodes: int  # total prompts consumed (episodes / rollout_batch iterations)

    @property
    def iterations(self) -> int:
        return self.episodes // self.rollout_batch

    @property
    def minibatch_size(self) -> int:
        return self.rollout_batch // self.num_minibatches


WORKLOADS = {
    "tiny": Workload("tiny", n_layer=2, n_head=2, n_embd=64, num_prompts=64, prompt_tokens=8,
                     response_tokens=16, rollout_batch=8, ppo_epochs=4, num_minibatches=1,
                     episodes=256),
    "small": Workload("small", n_layer=6, n_head=6, n_embd=384, num_prompts=64, prompt_tokens=32,
                      response_tokens=64, rollout_batch=16, ppo_epochs=4, num_minibatches=1,
                      episodes=64),
}


def make_prompts(w: Workload, seed: int = 0) -> list[str]:
    """``num_prompts`` ASCII strings of exactly ``prompt_tokens`` bytes (one token per byte)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return ["".join(rng.choice(letters) for _ in range(w.prompt_tokens)) for _ in range(w.num_prompts)]


def build_models(w: Workload, root: str | Path) -> tuple[Path, Path]:
    """Save (policy dir, reward-model dir) for the workload under ``root``; reuse if present."""
    root = Path(root)
    n_pos = max(256, w.prompt_tokens + w.response_tokens)
    policy = save_tiny_causal_lm(root / f"{w.name}-policy", w.n_layer, w.n_head, w.n_embd, n_pos)
    reward = save_tiny_reward_model(root / f"{w.name}-reward", w.n_layer, w.n_head, w.n_embd, n_pos)
    return policy, reward

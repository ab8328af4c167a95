"""``ppo.rollout_dump``: each iteration's episodes as JSON lines, for debugging.

``rollouts/iter_<k>.jsonl`` in the run directory (``iter_<k>.rank<r>.jsonl`` per rank under DDP),
one line per episode: the record's columns, ``prompt_ids`` and ``response_ids`` with no padding,
``loss_mask`` (one 0/1 per response id: 1 where the policy's own token trains), ``messages`` (the
prompt's and every turn's), ``reward`` (the reward's raw score), ``score`` (the score PPO learned
from) and ``turns``. Each file is written to a temporary name and renamed, so a killed run never
leaves half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def episode_rows(r, tokenizer) -> list[dict]:
    """The rows of a rollout (``algo.rollout.Rollout``): each episode as its batch dumps it
    (``envs.EpisodeBatch.dump_rows``; a single turn: its prompt as written, its response as one
    assistant message)."""
    return r.episodes.dump_rows(tokenizer, r.response_mask, r.raw_scores.tolist(), r.scores.tolist())


def write_rollout(directory: str | Path, iteration: int, rows: list[dict], rank: int = 0, world: int = 1) -> Path:
    """Write ``rows`` as ``<directory>/iter_<iteration>[.rank<r>].jsonl``, atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (f"iter_{iteration}.jsonl" if world == 1 else f"iter_{iteration}.rank{rank}.jsonl")
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, path)
    return path

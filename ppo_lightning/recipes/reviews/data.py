"""Movie reviews for an offline "positive reviews" RLHF demo: the data the reviews recipe draws
from its grammar (``grammar.py``), and the reward and metric functions its configs name.

The classic demo steers GPT-2 towards positive IMDB reviews with a sentiment classifier as the
reward. Here both the language and the judge are known exactly, so the demo runs offline and its
results can be checked. This module holds review openings to prompt with (:func:`prompts`), a
corpus for the supervised warm start (:func:`sft_corpus`), preference pairs for the reward model
(:func:`preference_pairs`, with ill-formed text from :func:`corrupt`), the word-level tokenizer
(:func:`build_tokenizer`), and :func:`reward_fn`, :func:`sentiment_fn` and :func:`well_formed_fn`
for ``reward.fn`` and ``eval.metrics``. Texts follow the grammar's conventions (``grammar.py``):
``prompt + response`` is the review, joined by :func:`join_text`.
"""

from __future__ import annotations

import random

from .grammar import (
    _as_rng,
    complete,
    CONNECTIVES,
    INTENSIFIERS,
    is_well_formed,
    join_text,
    POSITIVE,
    sample_review,
    sentiment,
    VOCAB,
)


def prompts(rng: random.Random | int, n: int, min_words: int = 2, max_words: int = 4) -> list[str]:
    """``n`` review openings of 2-4 words (``"the plot"``, ``"the acting was very"``) for PPO.

    Openings come from reviews of neutral positivity (0.5), so some already carry a negative
    adjective the policy must write around. Every opening can be completed (:func:`complete`).
    """
    rng = _as_rng(rng)
    return [" ".join(sample_review(rng, 0.5).split(" ")[: rng.randint(min_words, max_words)]) for _ in range(n)]


def sft_corpus(rng: random.Random | int, n: int) -> list[dict[str, str]]:
    """``n`` ``{"prompt", "response"}`` pairs for a supervised warm start, mixed sentiment.

    Each review's positivity is drawn uniformly from [0, 1], so the warm-started policy writes
    reviews of every sentiment and PPO has somewhere to go. The split follows the grammar's text
    conventions (``prompt + response`` is the review); append the EOS token to the response when
    training so the policy learns to stop.
    """
    rng = _as_rng(rng)
    out = []
    for _ in range(n):
        words = sample_review(rng, rng.random()).split(" ")
        k = rng.randint(2, 4)
        out.append({"prompt": " ".join(words[:k]), "response": " " + " ".join(words[k:])})
    return out


def preference_pairs(rng: random.Random | int, n: int, ill_formed_fraction: float = 0.0) -> list[dict[str, str]]:
    """``n`` ``{"prompt", "chosen", "rejected"}`` triples for training a reward model.

    Both responses continue the same prompt (each with its own positivity drawn uniformly) and
    ``chosen`` has strictly higher :func:`sentiment` of ``prompt + response``; ties are skipped.
    With ``ill_formed_fraction`` > 0, that share of pairs instead rejects a corrupted copy of a
    well-formed (and more positive) continuation (:func:`corrupt`): a reward model that has only
    seen grammatical text scores word salad arbitrarily, and PPO finds that gap within tens of
    iterations (reward hacking); these pairs teach it that broken text loses.
    """
    rng = _as_rng(rng)
    out = []
    while len(out) < n:
        prompt = prompts(rng, 1)[0]
        if rng.random() < ill_formed_fraction:
            good = complete(rng, prompt, 0.5 + 0.5 * rng.random())
            out.append({"prompt": prompt, "chosen": good, "rejected": corrupt(rng, prompt, good)})
            continue
        a, b = complete(rng, prompt, rng.random()), complete(rng, prompt, rng.random())
        sa, sb = sentiment(prompt + a), sentiment(prompt + b)
        if sa != sb:
            chosen, rejected = (a, b) if sa > sb else (b, a)
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def corrupt(rng: random.Random | int, prompt: str, response: str) -> str:
    """An ill-formed variant of ``response`` (so ``prompt + result`` fails :func:`is_well_formed`):
    truncated, a word dropped, repeated or replaced by another word of the vocabulary (which
    breaks agreement or word order), words shuffled, or positive adjectives piled up; or the two
    slips a policy pushed towards positive words makes most: a "." before the clause is complete
    ("the plot stayed deeply ."), more words after the final "." ("... fresh . superb ."), and
    one more positive word, intensifier or joiner where the grammar allows none ("really truly
    fresh", "fresh and warm and bold", "and the the")."""
    rng = _as_rng(rng)
    words = response.split()
    for _ in range(20):
        kind = rng.randrange(11)
        w = list(words)
        if kind in (9, 10):  # inflated: the way a policy pushed towards positive words drifts
            pool = rng.choice((POSITIVE, INTENSIFIERS, ("and", "the") + CONNECTIVES))
            w.insert(rng.randrange(len(w)), rng.choice(pool))
        elif kind == 7 and len(w) > 2:  # ends too early: cut before the last adjective, then "."
            w = w[: rng.randrange(1, len(w) - 1)] + ["."]
        elif kind == 8:  # runs on after the final "."
            for _ in range(rng.randint(1, 3)):
                w += ([rng.choice(INTENSIFIERS)] if rng.random() < 0.3 else []) + [rng.choice(POSITIVE), "."]
        elif kind == 0 and len(w) > 1:
            w = w[: rng.randrange(1, len(w))]  # stops early
        elif kind == 1 and len(w) > 1:
            del w[rng.randrange(len(w))]
        elif kind == 2:
            i = rng.randrange(len(w))
            w.insert(i, w[i])
        elif kind == 3:
            rng.shuffle(w)
        elif kind in (4, 5):
            w[rng.randrange(len(w))] = rng.choice(VOCAB)
        else:  # adjective salad, the usual reward hack
            w = [rng.choice(POSITIVE) for _ in range(rng.randint(1, 8))] + ([] if rng.random() < 0.5 else ["."])
        candidate = " " + " ".join(w)
        if not is_well_formed(join_text(prompt, candidate)):
            return candidate
    return " " + " ".join(rng.choice(POSITIVE) for _ in range(3))


def reward_fn(prompts: list[str], responses: list[str], ill_formed: float = -1.0) -> list[float]:
    """Ground-truth sentiment of each ``prompt + response``; ``ill_formed`` for texts off the grammar.

    For ``reward=function reward.fn=ppo_lightning.recipes.reviews.data.reward_fn``. Prompt and response
    are joined by :func:`join_text`, so decoded responses without their leading space score the
    same as raw ones.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    scores = []
    for p, r in zip(prompts, responses):
        text = join_text(p, r)
        scores.append(sentiment(text) if is_well_formed(text) else float(ill_formed))
    return scores


def sentiment_fn(prompts: list[str], responses: list[str]) -> list[float]:
    """The ground-truth :func:`sentiment` of each whole review (``eval.metrics.sentiment=...``)."""
    return [sentiment(join_text(p, r)) for p, r in zip(prompts, responses)]


def well_formed_fn(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the whole review is grammatical (:func:`is_well_formed`), else 0.0."""
    return [float(is_well_formed(join_text(p, r))) for p, r in zip(prompts, responses)]


def build_tokenizer():
    """A word-level tokenizer over :data:`VOCAB` (see :mod:`ppo_lightning.recipes.tokenizers`)."""
    from ppo_lightning.recipes.tokenizers import build_word_tokenizer

    return build_word_tokenizer(VOCAB)

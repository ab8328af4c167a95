"""The example problems (ppo_lightning/examples): grammar, ground-truth rewards, corpora and their tokenizers."""

from __future__ import annotations

import random
import statistics

import pytest

from ppo_lightning.recipes.arithmetic import data as arithmetic

from ppo_lightning.recipes.reviews import data as reviews
from ppo_lightning.recipes.reviews import grammar


# ----------------------------------------------------------------------------- reviews
def test_sampled_reviews_are_well_formed_and_sized():
    rng = random.Random(0)
    texts = [grammar.sample_review(rng, rng.random()) for _ in range(1000)]
    assert all(grammar.is_well_formed(t) for t in texts)
    lengths = [len(t.split(" ")) for t in texts]
    assert min(lengths) >= 10 and max(lengths) <= 18 and 10 < sum(lengths) / len(lengths) < 14
    assert all(t.endswith(" .") and "  " not in t for t in texts)
    vocab = set(grammar.VOCAB)
    assert 150 <= len(vocab) <= 300 and len(vocab) == len(grammar.VOCAB)
    assert {w for t in texts for w in t.split()} <= vocab


def test_grammar_is_deterministic():
    """Parsing in one pass relies on the word classes leaving each reachable state being disjoint."""
    seen, todo = set(), [grammar.START]
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        arcs = grammar._arcs(state)
        words = [w for cls, _, _ in arcs for w in grammar._CLASSES[cls]]
        assert len(words) == len(set(words)), state
        todo += [nxt for _, nxt, _ in arcs]
    assert grammar.END in seen


def test_sampling_is_reproducible():
    assert grammar.sample_review(7, 0.3) == grammar.sample_review(random.Random(7), 0.3)
    assert reviews.sft_corpus(3, 5) == reviews.sft_corpus(3, 5)
    assert arithmetic.sft_corpus(3, 5) == arithmetic.sft_corpus(3, 5)


def _corrupt(rng: random.Random, kind: str, words: list[str]) -> str:
    words = list(words)
    if kind == "drop":
        del words[rng.randrange(len(words))]
    elif kind == "swap":  # two positions holding different words
        i, j = rng.sample(range(len(words)), 2)
        while words[i] == words[j]:
            i, j = rng.sample(range(len(words)), 2)
        words[i], words[j] = words[j], words[i]
    elif kind == "truncate":
        words = words[: rng.randrange(1, len(words))]
    elif kind == "junk":
        words.append(rng.choice(grammar.VOCAB + ["xyzzy"]))
    elif kind == "repeat":
        i = rng.randrange(len(words))
        words.insert(i, words[i])
    elif kind == "salad":
        rng.shuffle(words)
    return " ".join(words)


def test_corrupted_reviews_are_rejected():
    # Measured on 20k samples: drop 94.7%, swap 93.9% rejected (dropping an intensifier or
    # swapping two adjectives or two nouns stays grammatical); the others 100%.
    rng = random.Random(1)
    rates = {}
    for kind in ("drop", "swap", "truncate", "junk", "repeat", "salad"):
        corrupted = [_corrupt(rng, kind, grammar.sample_review(rng, rng.random()).split(" ")) for _ in range(500)]
        rates[kind] = sum(not grammar.is_well_formed(t) for t in corrupted) / len(corrupted)
    assert rates["drop"] >= 0.9 and rates["swap"] >= 0.9, rates
    assert rates["truncate"] == rates["junk"] == rates["repeat"] == 1.0, rates
    assert rates["salad"] >= 0.99, rates
    assert sum(rates.values()) / len(rates) >= 0.95, rates


@pytest.mark.parametrize(
    "text",
    [
        "the acting was brilliant and the plot felt fresh .",
        "the film was dull but the music was lovely .",
        "the acting was very brilliant and fresh while the jokes were flat .",
        "the plot felt long and the cast seemed truly dull and weak .",
    ],
)
def test_handwritten_reviews_are_accepted(text):
    assert grammar.is_well_formed(text)


@pytest.mark.parametrize(
    "text",
    [
        "the acting was brilliant and the plot felt fresh",  # no final "."
        "the acting was brilliant and the plot felt fresh.",  # "." glued to the word
        "the acting was brilliant and the plot felt fresh .  ",  # trailing whitespace
        " the acting was brilliant and the plot felt fresh .",  # leading space
        "the acting  was brilliant and the plot felt fresh .",  # double space
        "the acting was brilliant .",  # one clause
        "the acting were brilliant and the plot felt fresh .",  # agreement
        "the jokes was brilliant and the plot felt fresh .",
        "the the acting was brilliant and the plot felt fresh .",
        "the acting was very very brilliant and the plot felt fresh .",
        "the acting was brilliant and fresh and witty but the plot felt fresh .",  # two coordinations
        "the acting was brilliant but the plot felt fresh but the music was lovely .",
        "the acting was brilliant and the plot felt fresh . .",
        "brilliant brilliant brilliant brilliant .",
        "",
    ],
)
def test_ill_formed_texts_are_rejected(text):
    assert not grammar.is_well_formed(text)


def test_sentiment_ground_truth():
    s = grammar.sentiment
    assert s("the acting was brilliant and the plot felt fresh .") == 1.0
    assert s("the film was dull but the music was lovely .") == 0.0
    assert s("the film was very dull but the music was lovely .") == pytest.approx(-0.25)
    assert s("the film was long but the music was lovely .") == pytest.approx(0.5)  # neutral dilutes
    assert s("the film was truly lovely but the music was lovely .") == 1.0  # clipped
    assert s("the film was truly dull but the music was dull .") == -1.0
    assert s("the film was long but the music was quiet .") == 0.0
    assert s("") == 0.0 and s("xyzzy the plot") == 0.0
    # positivity steers the mean sentiment monotonically, from clearly negative to clearly positive
    rng = random.Random(2)
    means = [sum(s(grammar.sample_review(rng, p)) for _ in range(300)) / 300 for p in (0, 0.5, 1)]
    assert means[0] < -0.6 and abs(means[1]) < 0.15 and means[2] > 0.6


def test_prompts_can_be_completed():
    rng = random.Random(3)
    ps = reviews.prompts(rng, 200)
    assert all(2 <= len(p.split(" ")) <= 4 and p == p.strip() for p in ps)
    assert len(set(ps)) > 100
    for p in ps:
        response = grammar.complete(rng, p, rng.random())
        assert response.startswith(" ") and not response.startswith("  ")
        assert grammar.is_well_formed(p + response)
    with pytest.raises(ValueError):
        grammar.complete(rng, "acting the", 0.5)
    with pytest.raises(ValueError):
        grammar.sample_review(rng, 1.5)


def test_sft_corpus_and_preference_pairs():
    rng = random.Random(4)
    corpus = reviews.sft_corpus(rng, 300)
    assert all(grammar.is_well_formed(ex["prompt"] + ex["response"]) for ex in corpus)
    assert all(ex["response"].startswith(" ") and not ex["prompt"].endswith(" ") for ex in corpus)
    sentiments = [grammar.sentiment(ex["prompt"] + ex["response"]) for ex in corpus]
    assert min(sentiments) == -1.0 and max(sentiments) == 1.0  # mixed sentiment

    pairs = reviews.preference_pairs(rng, 200)
    assert len(pairs) == 200
    for ex in pairs:
        chosen, rejected = ex["prompt"] + ex["chosen"], ex["prompt"] + ex["rejected"]
        assert grammar.is_well_formed(chosen) and grammar.is_well_formed(rejected)
        assert grammar.sentiment(chosen) > grammar.sentiment(rejected)


def test_reviews_reward_fn():
    good = "the acting was brilliant and the plot felt fresh ."
    prompts = ["the acting was"] * 4
    responses = [
        " brilliant and the plot felt fresh .",  # raw response, leading space
        "brilliant and the plot felt fresh .",  # decoded alone, no leading space
        " brilliant and the plot felt fresh",  # no "."
        " brilliant brilliant brilliant .",
    ]
    assert reviews.reward_fn(prompts, responses) == [1.0, 1.0, -1.0, -1.0]
    assert reviews.reward_fn(["the film was"], [" dull but the music was lovely ."]) == [0.0]
    assert reviews.reward_fn([""], [good]) == [1.0]
    assert reviews.reward_fn(["the plot"], [""], ill_formed=-2.0) == [-2.0]
    with pytest.raises(ValueError):
        reviews.reward_fn(["a"], [])


# ----------------------------------------------------------------------------- arithmetic
def test_arithmetic_prompts_and_reward():
    rng = random.Random(5)
    ps = arithmetic.prompts(rng, 500, ops="+-*")
    assert all(set(p) <= set(arithmetic.VOCAB) and p.endswith("=") for p in ps)
    assert {p for p in ps if "*" in p} and {p for p in ps if "-" in p}
    assert arithmetic.answer("12+7=") == 19 and arithmetic.answer("3-7=") == -4
    assert arithmetic.answer("20*20=") == 400
    right = [str(arithmetic.answer(p)) for p in ps]
    assert arithmetic.reward_fn(ps, right) == [1.0] * len(ps)
    assert arithmetic.reward_fn(
        ["12+7=", "12+7=", "12+7=", "12+7=", "3-7=", "3-7=", "3-7=", "12+7="],
        ["19", " 19 ", "20", "", "-4", "4", "--4", "19+1"],
    ) == [1, 1, 0, 0, 1, 0, 1, 1]
    with pytest.raises(ValueError):
        arithmetic.reward_fn(["hello"], ["1"])
    with pytest.raises(ValueError):
        arithmetic.prompts(rng, 1, ops="/")


def test_arithmetic_sft_corpus_is_partly_correct():
    rng = random.Random(6)
    corpus = arithmetic.sft_corpus(rng, 2000, accuracy=0.6)
    ps, rs = [ex["prompt"] for ex in corpus], [ex["response"] for ex in corpus]
    assert 0.56 < statistics.mean(arithmetic.reward_fn(ps, rs)) < 0.64
    errors = [int(r) - arithmetic.answer(p) for p, r in zip(ps, rs)]
    assert {e for e in errors if e} == {-2, -1, 1, 2}
    assert sum(abs(e) == 1 for e in errors) > 2 * sum(abs(e) == 2 for e in errors)
    assert (
        arithmetic.reward_fn(
            *zip(*[(e["prompt"], e["response"]) for e in arithmetic.sft_corpus(rng, 50, accuracy=1.0)])
        )
        == [1.0] * 50
    )


# ----------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def review_tok():
    return reviews.build_tokenizer()


@pytest.fixture(scope="module")
def arith_tok():
    return arithmetic.build_tokenizer()


def test_review_tokenizer_round_trip(review_tok):
    tok = review_tok
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    assert len(tok) == len(grammar.VOCAB) + 3
    rng = random.Random(7)
    for _ in range(200):
        text = grammar.sample_review(rng, rng.random())
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.split(" ")) and tok.unk_token_id not in ids
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    # extra whitespace is normalised to single spaces; unknown words become <|unk|>
    assert tok.decode(tok("the  plot\tfelt fresh .")["input_ids"]) == "the plot felt fresh ."
    assert tok("the plot felt groovy")["input_ids"][-1] == tok.unk_token_id
    batch = tok(["the plot", "the plot felt fresh"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2 and batch["attention_mask"][0][:2] == [0, 0]


def test_arithmetic_tokenizer_round_trip(arith_tok):
    tok = arith_tok
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    ids = tok("12+7=", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "+", "7", "="]
    assert tok.decode(ids) == "12+7="
    assert tok.decode(tok("3-7=-4" + tok.eos_token)["input_ids"], skip_special_tokens=True) == "3-7=-4"
    assert tok.decode(tok("12 + 7 =")["input_ids"]) == "12+7="


@pytest.mark.parametrize("recipe", ["reviews", "arithmetic"])
def test_tokenizer_save_and_reload(recipe, tmp_path, review_tok, arith_tok):
    from transformers import AutoTokenizer

    tok = review_tok if recipe == "reviews" else arith_tok
    text = "the film was dull but the music was lovely ." if recipe == "reviews" else "12+7=19"
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    specials = ("eos_token", "pad_token", "unk_token")
    assert [getattr(loaded, s) for s in specials] == [getattr(tok, s) for s in specials]
    assert loaded.pad_token_id != loaded.eos_token_id and loaded.padding_side == "left"
    assert len(loaded) == len(tok)


def _split_decode(tok, prompt_text: str, full_text: str, n_pad: int = 2):
    """What the PPO rollout scores: prompt and response decoded separately, as batch_decode does.

    The response row ends with EOS and then pad (masked positions), as after generation.
    """
    full = tok(full_text, add_special_tokens=False)["input_ids"]
    k = len(tok(prompt_text, add_special_tokens=False)["input_ids"])
    prompt_ids = [tok.pad_token_id] * n_pad + full[:k]  # left-padded prompt
    response_ids = full[k:] + [tok.eos_token_id] + [tok.pad_token_id] * n_pad
    p, r = tok.batch_decode([prompt_ids, response_ids], skip_special_tokens=True)
    return p, r


def test_reviews_end_to_end_split_decoding(review_tok):
    rng = random.Random(8)
    for ex in reviews.sft_corpus(rng, 100):
        full = ex["prompt"] + ex["response"]
        p, r = _split_decode(review_tok, ex["prompt"], full)
        assert p == ex["prompt"] and r == ex["response"].lstrip()  # the leading space is lost
        assert grammar.join_text(p, r) == full and grammar.is_well_formed(grammar.join_text(p, r))
        assert reviews.reward_fn([p], [r]) == [grammar.sentiment(full)]


def test_arithmetic_end_to_end_split_decoding(arith_tok):
    rng = random.Random(9)
    corpus = arithmetic.sft_corpus(rng, 100, accuracy=0.5, ops="+-*")
    for ex in corpus:
        p, r = _split_decode(arith_tok, ex["prompt"], ex["prompt"] + ex["response"])
        assert (p, r) == (ex["prompt"], ex["response"])
        assert arithmetic.reward_fn([p], [r]) == arithmetic.reward_fn([ex["prompt"]], [ex["response"]])


def test_reward_fns_import_as_config_paths():
    from ppo_lightning.rewards.function import FunctionReward

    fn = FunctionReward("ppo_lightning.recipes.reviews.data.reward_fn")
    assert list(fn(["the plot was"], ["dull but the music was lovely ."])) == [0.0]
    fn = FunctionReward("ppo_lightning.recipes.reviews.data.reward_fn", {"ill_formed": -2.0})
    assert list(fn(["the plot was"], ["dull ."])) == [-2.0]
    fn = FunctionReward("ppo_lightning.recipes.arithmetic.data.reward_fn")
    assert list(fn(["12+7="], ["19"])) == [1.0]

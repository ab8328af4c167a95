"""The language of the reviews recipe: short movie reviews from a small probabilistic grammar, its
vocabulary, and the ground truth that judges a text.

Both the language and the judge are known exactly: every adjective carries a polarity,
:func:`sentiment` is the ground truth and :func:`is_well_formed` tells whether the policy still
writes the language or has collapsed into adjective salad (the reward-hacking failure PPO's KL
penalty is there to prevent).

Grammar (a review is 10-18 words including the final ``"."``)::

    review  := clause CONN clause "."
    clause  := "the" NOUN VERB adj ["and" adj]        # at most one coordinated adjective
    adj     := [INTENSIFIER] ADJECTIVE
    NOUN VERB agree in number: singular nouns take "was", plural ones "were"

``"and"`` is also a connective, e.g. ``"the acting was brilliant and the plot felt fresh ."``.
The grammar is written as a deterministic automaton (:func:`_arcs`): the word classes leaving a
state are disjoint, so one pass parses a text exactly, and sampling can continue from any prefix.

Text conventions: words are joined by single spaces, the final ``"."`` is a word of its own
(``"fresh ."``), no leading or trailing whitespace. A prompt is an opening without a trailing
space (``"the acting was"``) and a response starts with a space (``" brilliant and ... ."``), so
``prompt + response`` is the review. A word-level tokenizer decodes a response alone *without*
its leading space, so the reward functions (``data.py``) join prompt and response with
:func:`join_text`, which puts exactly one space at the seam either way.
"""

from __future__ import annotations

import random

# ----------------------------------------------------------------------------- the vocabulary
NOUNS_SINGULAR = (
    "acting",
    "plot",
    "music",
    "ending",
    "film",
    "movie",
    "cast",
    "dialogue",
    "script",
    "pacing",
    "story",
    "score",
    "soundtrack",
    "direction",
    "editing",
    "cinematography",
    "lead",
    "villain",
    "hero",
    "humor",
    "twist",
    "finale",
    "premise",
    "setting",
    "camera",
    "romance",
    "climax",
    "screenplay",
    "performance",
    "opening",
    "sequel",
    "director",
    "writing",
    "tone",
    "atmosphere",
)
NOUNS_PLURAL = (
    "characters",
    "effects",
    "visuals",
    "costumes",
    "jokes",
    "performances",
    "actors",
    "scenes",
    "songs",
    "battles",
)
VERBS_COMMON = ("seemed", "felt", "looked", "sounded", "remained", "became", "proved", "appeared", "stayed")
POSITIVE = (
    "brilliant",
    "fresh",
    "lovely",
    "wonderful",
    "superb",
    "excellent",
    "great",
    "charming",
    "delightful",
    "gripping",
    "moving",
    "stunning",
    "beautiful",
    "clever",
    "witty",
    "funny",
    "engaging",
    "powerful",
    "memorable",
    "magical",
    "thrilling",
    "touching",
    "inspired",
    "elegant",
    "graceful",
    "vivid",
    "smart",
    "sharp",
    "tender",
    "warm",
    "joyful",
    "uplifting",
    "masterful",
    "compelling",
    "heartfelt",
    "hilarious",
    "polished",
    "gorgeous",
    "splendid",
    "fantastic",
    "terrific",
    "marvelous",
    "fun",
    "enjoyable",
    "riveting",
    "captivating",
    "rich",
    "bold",
    "sincere",
    "solid",
)
NEGATIVE = (
    "dull",
    "boring",
    "awful",
    "terrible",
    "bland",
    "clumsy",
    "tedious",
    "weak",
    "flat",
    "messy",
    "lifeless",
    "stale",
    "silly",
    "forgettable",
    "painful",
    "annoying",
    "lazy",
    "shallow",
    "predictable",
    "confusing",
    "cheap",
    "wooden",
    "awkward",
    "bad",
    "poor",
    "dreadful",
    "horrible",
    "tiresome",
    "pointless",
    "hollow",
    "sloppy",
    "dreary",
    "grating",
    "stiff",
    "muddled",
    "pretentious",
    "bloated",
    "mediocre",
    "lousy",
    "dismal",
    "trite",
    "drab",
    "insipid",
    "limp",
    "overwrought",
    "uninspired",
    "derivative",
    "unfunny",
    "ugly",
    "cold",
)
NEUTRAL = (
    "long",
    "short",
    "quiet",
    "loud",
    "dark",
    "simple",
    "strange",
    "unusual",
    "familiar",
    "modern",
    "old",
    "subtle",
    "serious",
    "busy",
    "light",
    "plain",
    "brief",
    "odd",
    "straightforward",
    "minimal",
    "traditional",
    "colorful",
)
INTENSIFIERS = (
    "very",
    "truly",
    "really",
    "quite",
    "so",
    "rather",
    "deeply",
    "incredibly",
    "extremely",
    "genuinely",
    "remarkably",
    "utterly",
    "thoroughly",
    "absolutely",
)
CONNECTIVES = ("but", "while", "although", "though", "yet", "whereas", "because", "since", "as")
# ("and" is a connective too, but it also coordinates adjectives, so it is a class of its own)

# word classes of the automaton; each word belongs to exactly one class
_CLASSES: dict[str, tuple[str, ...]] = {
    "the": ("the",),
    "and": ("and",),
    ".": (".",),
    "noun_s": NOUNS_SINGULAR,
    "noun_p": NOUNS_PLURAL,
    "verb_s": ("was",) + VERBS_COMMON,
    "verb_p": ("were",) + VERBS_COMMON,
    "pos": POSITIVE,
    "neg": NEGATIVE,
    "neu": NEUTRAL,
    "intens": INTENSIFIERS,
    "conn": CONNECTIVES,
}
_SETS = {name: frozenset(words) for name, words in _CLASSES.items()}

VOCAB: list[str] = list(dict.fromkeys(w for words in _CLASSES.values() for w in words))
"""Every word of the language, in a fixed order (``data.build_tokenizer``'s vocabulary)."""

POLARITY: dict[str, int] = {**{w: 1 for w in POSITIVE}, **{w: -1 for w in NEGATIVE}, **{w: 0 for w in NEUTRAL}}
"""Sentiment of each adjective: +1 positive, -1 negative, 0 neutral."""

INTENSIFIER_SCALE = 1.5

_words = [w for name, ws in _CLASSES.items() if name != "verb_p" for w in ws] + ["were"]
assert len(_words) == len(set(_words)), "a word belongs to two classes"  # only the verbs are shared

# ----------------------------------------------------------------------------- the automaton
_NEUTRAL_P = 0.2  # chance an adjective is neutral; the rest split by ``positivity``
_INTENS_P = 0.25  # chance an adjective slot starts with an intensifier
_PLURAL_P = 0.2  # chance a subject is plural
State = tuple  # (slot, clause index 0/1, coordinated adjective already used)
START: State = ("start", 0, False)
END: State = ("end", 1, True)


def _adj_arcs(nxt: State, weight: float, positivity: float) -> list:
    """Arcs of one adjective: its polarity drawn by ``positivity`` (zero-weight arcs still parse)."""
    polar = weight * (1 - _NEUTRAL_P)
    return [("pos", nxt, polar * positivity), ("neg", nxt, polar * (1 - positivity)), ("neu", nxt, weight * _NEUTRAL_P)]


def _arcs(state: State, positivity: float = 0.5) -> list[tuple[str, State, float]]:
    """Outgoing arcs ``(word class, next state, weight)``; the classes leaving a state are disjoint."""
    slot, c, coord = state
    if slot == "start":
        return [("the", ("noun", c, coord), 1.0)]
    if slot == "noun":
        return [("noun_s", ("verb_s", c, coord), 1 - _PLURAL_P), ("noun_p", ("verb_p", c, coord), _PLURAL_P)]
    if slot in ("verb_s", "verb_p"):
        return [(slot, ("adj", c, coord), 1.0)]
    if slot == "adj":
        return [("intens", ("bare", c, coord), _INTENS_P)] + _adj_arcs(("after", c, coord), 1 - _INTENS_P, positivity)
    if slot == "bare":  # after an intensifier
        return _adj_arcs(("after", c, coord), 1.0, positivity)
    if slot == "after":  # after an adjective
        if c == 0 and not coord:  # "and" may coordinate an adjective or start clause 2
            return [("and", ("and", 0, False), 0.4), ("conn", ("start", 1, False), 0.6)]
        if c == 0:
            return [("and", ("start", 1, False), 0.3), ("conn", ("start", 1, False), 0.7)]
        if not coord:
            return [(".", END, 0.75), ("and", ("adj", 1, True), 0.25)]
        return [(".", END, 1.0)]
    if slot == "and":  # "and" after clause 1's first adjective: a second adjective, or clause 2
        return [("the", ("noun", 1, False), 0.4), ("intens", ("bare", 0, True), 0.15)] + _adj_arcs(
            ("after", 0, True), 0.45, positivity
        )
    if slot == "end":
        return []
    raise ValueError(f"unknown grammar state {state!r}")


def _walk(words: list[str], state: State = START) -> State | None:
    """The state after reading ``words``, or None when they leave the grammar."""
    for w in words:
        for cls, nxt, _ in _arcs(state):
            if w in _SETS[cls]:
                state = nxt
                break
        else:
            return None
    return state


def _sample_from(rng: random.Random, state: State, positivity: float) -> list[str]:
    words = []
    while state != END:
        arcs = _arcs(state, positivity)
        cls, state, _ = rng.choices(arcs, weights=[w for _, _, w in arcs])[0]
        words.append(rng.choice(_CLASSES[cls]))
    return words


def _as_rng(rng: random.Random | int) -> random.Random:
    return rng if isinstance(rng, random.Random) else random.Random(rng)


def _check_positivity(positivity: float) -> None:
    if not 0.0 <= positivity <= 1.0:
        raise ValueError(f"positivity={positivity} must lie in [0, 1]")


# ----------------------------------------------------------------------------- sample, parse, judge
def sample_review(rng: random.Random | int, positivity: float = 0.5) -> str:
    """One review; each polar adjective is positive with probability ``positivity``."""
    _check_positivity(positivity)
    return " ".join(_sample_from(_as_rng(rng), START, positivity))


def complete(rng: random.Random | int, prompt: str, positivity: float = 0.5) -> str:
    """A response (leading space included) that turns ``prompt`` into a well-formed review."""
    _check_positivity(positivity)
    state = _walk(prompt.split(" ")) if prompt else START
    if state is None or state == END:
        raise ValueError(f"{prompt!r} is not the opening of an unfinished review")
    return " " + " ".join(_sample_from(_as_rng(rng), state, positivity))


def is_well_formed(text: str) -> bool:
    """Whether the grammar generates exactly ``text`` (single spaces, final ``" ."``, nothing after)."""
    return _walk(text.split(" ")) == END


def sentiment(text: str) -> float:
    """Ground-truth sentiment in [-1, 1]: the mean polarity of the adjectives (0 if none).

    Neutral adjectives count as 0 (so they dilute the score), an intensifier right before an
    adjective scales its polarity by 1.5, and the mean is clipped to [-1, 1]: one intensified
    positive adjective can outweigh a negative one, but a review cannot score above 1. Defined on
    any text (unknown words are ignored), deterministic; well-formedness is checked separately.
    """
    words = text.split()
    scores = [
        POLARITY[w] * (INTENSIFIER_SCALE if i and words[i - 1] in _SETS["intens"] else 1.0)
        for i, w in enumerate(words)
        if w in POLARITY
    ]
    if not scores:
        return 0.0
    return max(-1.0, min(1.0, sum(scores) / len(scores)))


def join_text(prompt: str, response: str) -> str:
    """``prompt`` + ``response`` with exactly one space at the seam.

    A response decoded on its own by a word-level tokenizer has lost its leading space
    (``"brilliant ..."``) while a raw response keeps it (``" brilliant ..."``); both join to the
    same review. Whitespace inside either part is left alone, so :func:`is_well_formed` still
    sees it.
    """
    prompt, response = prompt.rstrip(" "), response.lstrip(" ")
    return f"{prompt} {response}" if prompt and response else prompt + response

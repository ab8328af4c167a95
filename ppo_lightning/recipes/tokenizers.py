"""Word- and character-level tokenizers over an example's fixed vocabulary, built offline.

An example's closed vocabulary needs no learned BPE: one token per word (reviews) or
per character (arithmetic) keeps the models tiny and makes every sampled token a meaningful unit.
The result is a ``transformers.PreTrainedTokenizerFast``, so it goes through the same
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` path as a hub tokenizer.

Ids: the words in the given order are ``0..len(words)-1``, then ``<|endoftext|>`` (EOS, also BOS),
``<|pad|>`` (pad, distinct from EOS as PPO needs) and ``<|unk|>``. Padding is on the left, as
generation needs.

Decoding:

- word level (``char_level=False``): text is split on whitespace and decoded with single spaces
  between tokens. A response decoded on its own therefore has no leading space; the examples'
  reward functions join prompt and response accordingly (``reviews.join_text``).
- character level (``char_level=True``): text is split into single characters (whitespace is
  dropped) and decoded by fusing tokens without spaces, so ``"12+7="`` is ``1 2 + 7 =`` and decodes
  back to ``"12+7="``; decoded prompt + decoded response is the original text.

Either way ``clean_up_tokenization_spaces`` is off: it would turn ``"fresh ."`` into ``"fresh."``.
Special tokens, ``<|unk|>`` included, are dropped by ``skip_special_tokens=True``; an unknown word
therefore vanishes from decoded text rather than appearing as ``<|unk|>``.
"""

from __future__ import annotations

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)


def build_word_tokenizer(words: list[str], *, char_level: bool = False):
    """A ``PreTrainedTokenizerFast`` with one token per word (or per character) of ``words``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(words)
    if len(set(words)) != len(words):
        raise ValueError("the vocabulary repeats a word")
    bad = [w for w in words if not w or w != "".join(w.split()) or w in SPECIAL_TOKENS or (char_level and len(w) != 1)]
    if bad:
        raise ValueError(f"not valid {'characters' if char_level else 'words'} for a vocabulary: {bad[:5]}")

    vocab = {w: i for i, w in enumerate(words + list(SPECIAL_TOKENS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    if char_level:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
        )
        tok.decoder = decoders.Fuse()  # join tokens without spaces
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: tokens joined by " "
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # matched before pre-tokenisation
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def build_bpe_tokenizer(
    corpus: list[str], *, vocab_size: int, added: tuple[str, ...] = (), chat_template: str | None = None
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus``: every digit split off
    as a token of its own, merges across any other characters (no pre-tokenising regex), the
    ``added`` tokens matched whole before the split (chat markers, tool-call tags; kept by
    decoding), and EOS, pad and unk as above. Decoding gives back the text exactly."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
        chat_template=chat_template,
    )

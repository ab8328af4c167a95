"""Rewards: ``FunctionReward`` / ``build_reward`` (kind=function), ``RewardModel`` (kind=model), rules."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_lightning.config import RewardConfig
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.rewards import FunctionReward, RewardError, RewardModel, build_reward, fit_normalization
from ppo_lightning.rewards.rules import char_fraction, keyword, target_length

HERE = __name__  # "tests.test_rewards" under pytest (tests/ is a package)

PROMPTS = ["Once upon", "The cat", "Hello there"]
RESPONSES = [" a time", " sat down", "!"]

# ---------------------------------------------------------------------------------------------
# Callables imported by dotted path from this module.

CALLS: list[dict] = []
NOT_CALLABLE = 42


def recording_fn(prompts, responses, offset=0.0, scale=1.0):
    """Records what it was called with; scores = scale * len(response) + offset."""
    CALLS.append({"prompts": list(prompts), "responses": list(responses), "offset": offset, "scale": scale})
    return [scale * len(r) + offset for r in responses]


def misbehaving_fn(prompts, responses, mode="ok"):
    """Returns a deliberately bad output selected by ``mode`` (passed through reward.kwargs)."""
    n = len(responses)
    if mode == "ok":
        return [0.5] * n
    if mode == "short":
        return [0.5] * (n - 1)
    if mode == "long":
        return [0.5] * (n + 1)
    if mode == "string":
        return [0.5, "0.7", 0.5][:n]
    if mode == "none":
        return [0.5, 0.5, None][:n]
    if mode == "nan":
        return [0.5, float("nan"), 0.5][:n]
    if mode == "inf":
        return [0.5, 0.5, float("inf")][:n]
    if mode == "tensor_nan":
        return torch.tensor([0.5, 0.5, float("nan")][:n], dtype=torch.float64)
    if mode == "scalar":
        return 3.0
    if mode == "tensor":
        return torch.tensor([1, 2, 3][:n], dtype=torch.int64)
    raise AssertionError(mode)


def _fn_reward(mode: str) -> FunctionReward:
    return build_reward(RewardConfig(kind="function", fn=f"{HERE}.misbehaving_fn", kwargs={"mode": mode}))


# ---------------------------------------------------------------------------------------------
# kind=function


def test_function_reward_calls_fn_with_texts_and_kwargs():
    CALLS.clear()
    reward = build_reward(
        RewardConfig(kind="function", fn=f"{HERE}.recording_fn", kwargs={"offset": 0.25, "scale": 2.0})
    )
    assert isinstance(reward, FunctionReward)
    scores = reward(PROMPTS, RESPONSES)
    assert CALLS == [{"prompts": PROMPTS, "responses": RESPONSES, "offset": 0.25, "scale": 2.0}]
    assert isinstance(scores, torch.Tensor)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor([14.25, 18.25, 2.25]))


def test_function_reward_colon_path_and_no_kwargs():
    CALLS.clear()
    reward = FunctionReward(f"{HERE}:recording_fn")
    scores = reward(PROMPTS, RESPONSES)
    assert CALLS[0]["offset"] == 0.0 and CALLS[0]["scale"] == 1.0
    torch.testing.assert_close(scores, torch.tensor([7.0, 9.0, 1.0]))


def test_function_reward_tensor_output_becomes_float32():
    scores = _fn_reward("tensor")(PROMPTS, RESPONSES)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([1.0, 2.0, 3.0]))


def test_build_reward_builtin_rule_via_compose(tmp_path, cache_dir):
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["reward=char_fraction"], tmp_path, cache_dir)
    scores = build_reward(cfg.reward)(["p", "p"], ["abc", "A1"])
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize(
    "path, expected",
    [
        ("tests.no_such_module_xyz.fn", ["reward.fn", "tests.no_such_module_xyz", "cannot import"]),
        (f"{HERE}.no_such_attr", ["reward.fn", "no_such_attr", HERE]),
        (f"{HERE}.NOT_CALLABLE", ["reward.fn", "NOT_CALLABLE", "not a callable"]),
        ("nodots", ["reward.fn", "nodots", "dotted path"]),
    ],
)
def test_function_reward_import_errors(path, expected):
    with pytest.raises(ConfigError) as e:
        build_reward(RewardConfig(kind="function", fn=path))
    for s in expected:
        assert s in str(e.value), (s, str(e.value))


def test_build_reward_empty_fn_and_bad_kind():
    with pytest.raises(ConfigError, match="reward.fn"):
        build_reward(RewardConfig(kind="function", fn=None))
    with pytest.raises(ConfigError, match="reward.kind='bogus'"):
        build_reward(RewardConfig(kind="bogus"))
    with pytest.raises(ConfigError, match="reward.name_or_path"):
        build_reward(RewardConfig(kind="model", name_or_path=None))


@pytest.mark.parametrize("mode, n", [("short", 2), ("long", 4)])
def test_function_reward_wrong_length(mode, n):
    with pytest.raises(RewardError) as e:
        _fn_reward(mode)(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert "misbehaving_fn" in msg and f"returned {n} scores for 3 responses" in msg


def test_function_reward_none_means_it_does_not_apply():
    """None is not an error: "this reward does not apply to this response" (score 0, applies
    False; NaN when called on texts alone)."""
    from ppo_lightning.rewards.base import RewardBatch

    fn = _fn_reward("none")
    values, applies, _ = fn.score(RewardBatch.of_texts(PROMPTS, RESPONSES))
    assert values.tolist() == [0.5, 0.5, 0.0] and applies.tolist() == [True, True, False]
    assert torch.isnan(fn(PROMPTS, RESPONSES)[2])


@pytest.mark.parametrize("mode, index, shown", [("string", 1, "'0.7'")])
def test_function_reward_non_number_element(mode, index, shown):
    with pytest.raises(RewardError) as e:
        _fn_reward(mode)(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert "misbehaving_fn" in msg
    assert shown in msg
    assert f"prompt {index} {PROMPTS[index]!r}" in msg


@pytest.mark.parametrize("mode, index, shown", [("nan", 1, "nan"), ("inf", 2, "inf"), ("tensor_nan", 2, "nan")])
def test_function_reward_nonfinite_refused_when_asked(mode, index, shown):
    with pytest.raises(RewardError) as e:
        FunctionReward(f"{HERE}.misbehaving_fn", {"mode": mode}, allow_nonfinite=False)(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert "misbehaving_fn" in msg and "finite" in msg
    assert f"returned {shown} for prompt {index} {PROMPTS[index]!r}" in msg


def test_function_reward_nonfinite_passes_through_by_default():
    """PPO skips (and counts) an iteration with a NaN score rather than dying on it."""
    scores = _fn_reward("nan")(PROMPTS, RESPONSES)
    assert math.isnan(scores[1].item()) and scores[0].item() == 0.5


def raises_on_long_prompts(prompts, responses):
    """Fails for one specific row, as a buggy parser would."""
    return [1.0 / (len(p) < 12) for p in prompts]


def test_function_reward_that_raises_names_the_prompt():
    reward = FunctionReward(f"{HERE}.raises_on_long_prompts")
    prompts = ["short", "a much longer prompt", "tiny"]
    with pytest.raises(RewardError) as e:
        reward(prompts, ["x", "y", "z"])
    msg = str(e.value)
    assert "raises_on_long_prompts raised ZeroDivisionError" in msg
    assert "prompt 1 'a much longer prompt'" in msg


def test_function_reward_non_iterable():
    with pytest.raises(RewardError) as e:
        _fn_reward("scalar")(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert "misbehaving_fn" in msg and "float" in msg and "not a list" in msg


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_check_scores_numpy_arrays(dtype):
    import numpy as np

    from ppo_lightning.rewards import check_scores

    scores = check_scores(np.array([1, 0], dtype=dtype), ["a", "b"], "numpy_fn")
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0]))


# ---------------------------------------------------------------------------------------------
# kind=model


@pytest.fixture(scope="module")
def rm_texts():
    # mixed lengths so every batch has right padding
    prompts = ["Hi", "The quick brown fox", "a", "Once upon a time there was", "xyz"]
    responses = [" there", " jumps over the lazy dog again", "b", " a cat.", ""]
    return prompts, responses


def _manual_scores(rm_dir, prompts, responses):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            enc = tok(p + r, return_tensors="pt")  # one row: no padding at all
            out.append(model(**enc).logits[0, 0].float())
    return torch.stack(out)


def test_reward_model_matches_unpadded_forward(tiny_rm_dir, rm_texts):
    prompts, responses = rm_texts
    expected = _manual_scores(tiny_rm_dir, prompts, responses)
    rm = build_reward(RewardConfig(kind="model", name_or_path=str(tiny_rm_dir), batch_size=32))
    assert isinstance(rm, RewardModel)
    assert rm.tokenizer.padding_side == "right"
    scores = rm(prompts, responses)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    # small batches (2 + 2 + 1) give the same scores as one batch
    rm.batch_size = 2
    torch.testing.assert_close(rm(prompts, responses), scores, atol=1e-5, rtol=0)


def test_reward_model_token_path_matches_text_path(tiny_lm_dir, tiny_rm_dir, rm_texts):
    """Scoring the policy's token ids (left pads, EOS, pads after EOS) gives the text path's scores."""
    from ppo_lightning.models.policy import load_tokenizer
    from ppo_lightning.rewards.base import decode_prompts_and_responses
    from ppo_lightning.rewards.dispatch import score_responses

    tok = load_tokenizer(str(tiny_lm_dir))  # the policy's: left padding, pad distinct from EOS
    prompts, responses = rm_texts
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # left padding present
    R = max(len(tok(r)["input_ids"]) for r in responses) + 2
    rows = []
    for i, r in enumerate(responses):  # response, EOS on all rows but the first, then pads
        ids = tok(r)["input_ids"] + ([tok.eos_token_id] if i else [])
        rows.append(ids + [tok.pad_token_id] * (R - len(ids)))
    resp = torch.tensor(rows)
    mask = torch.tensor(
        [
            [1.0] * (len(tok(r)["input_ids"]) + (1 if i else 0))
            + [0.0] * (R - len(tok(r)["input_ids"]) - (1 if i else 0))
            for i, r in enumerate(responses)
        ]
    )
    rm = RewardModel(str(tiny_rm_dir), batch_size=2)
    p_text, r_text = decode_prompts_and_responses(tok, enc.input_ids, resp, mask)
    assert (p_text, r_text) == (prompts, responses)
    text_scores = score_responses(rm, tok, enc.input_ids, enc.attention_mask, resp, mask)
    assert rm.use_policy_tokens(tok, "auto") and rm.token_input
    token_scores = score_responses(rm, tok, enc.input_ids, enc.attention_mask, resp, mask)
    torch.testing.assert_close(token_scores, text_scores, atol=1e-5, rtol=0)
    torch.testing.assert_close(text_scores, _manual_scores(tiny_rm_dir, prompts, responses), atol=1e-5, rtol=0)
    assert not rm.use_policy_tokens(tok, "text") and not rm.token_input


def test_reward_model_token_input_needs_the_policy_vocabulary(tiny_rm_dir):
    from ppo_lightning.recipes.tokenizers import build_word_tokenizer

    words = build_word_tokenizer(["the", "film", "was", "good"])
    rm = RewardModel(str(tiny_rm_dir))
    assert not rm.use_policy_tokens(words, "auto") and not rm.token_input  # falls back to text
    with pytest.raises(ConfigError, match=r"reward.input=tokens.*different vocabulary"):
        rm.use_policy_tokens(words, "tokens")
    with pytest.raises(ConfigError, match="reward.input='sometimes'"):
        rm.use_policy_tokens(words, "sometimes")


def test_reward_model_frozen_and_eval(tiny_rm_dir):
    rm = RewardModel(str(tiny_rm_dir))
    # the wrapped classifier starts in eval (the wrapper's own flag is only fixed by .train()/.eval())
    assert not any(m.training for m in rm.model.modules())
    ret = rm.train()
    assert ret is rm
    assert not rm.training and not any(m.training for m in rm.modules())
    rm.train(True)
    assert not any(m.training for m in rm.modules())
    assert all(not p.requires_grad for p in rm.parameters())
    assert sum(1 for _ in rm.parameters()) > 0


def test_reward_model_missing_dir(tmp_path):
    missing = tmp_path / "no_such_rm"
    with pytest.raises(ConfigError) as e:
        build_reward(RewardConfig(kind="model", name_or_path=str(missing)))
    assert "reward.name_or_path" in str(e.value) and str(missing) in str(e.value)


# ---------------------------------------------------------------------------------------------
# rules


def test_char_fraction():
    assert char_fraction(["p"] * 4, ["abc", "aB1 ", "", "XYZ"]) == [1.0, 0.5, 0.0, 0.0]
    assert char_fraction(["p"], ["aab"], chars="a") == [pytest.approx(2 / 3)]


def test_keyword():
    assert keyword(["p"] * 3, ["very GOOD", "bad", "goodness"]) == [1.0, 0.0, 1.0]
    assert keyword(["p"] * 2, ["Yes!", "no"], word="YES") == [1.0, 0.0]


def test_target_length():
    assert target_length(["p"] * 3, ["a" * 32, "a" * 16, "a" * 48]) == [0.0, -0.5, -0.5]
    assert target_length(["p"] * 2, ["abcd", ""], target=4) == [0.0, -1.0]


# ============================================================================ normalisation
def test_fit_normalization_maps_reference_scores_to_mean_0_std_1():
    raw = torch.tensor([0.0, 0.0, 0.02, 0.0, 0.05, 0.01, 0.0, 0.0])  # a sparse, small-scale reward
    gain, bias = fit_normalization(raw)
    z = gain * raw.double() + bias
    assert z.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert z.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-9)
    assert gain == pytest.approx(1.0 / raw.double().std(unbiased=False).item(), rel=1e-6)


def test_fit_normalization_pools_ranks_through_reduce():
    """Under DDP each rank passes its own scores and a summing reduce; every rank must get the
    gain and bias of all ranks' scores together."""
    a, b = torch.tensor([0.1, 0.4, 0.2]), torch.tensor([1.0, -0.5, 0.3, 0.0])

    def reduce_with(other_scores):
        def reduce(stats):
            finite = other_scores.double()
            return stats + torch.stack(
                [
                    finite.sum(),
                    (finite**2).sum(),
                    torch.tensor(4.0, dtype=torch.float64),
                    torch.tensor(4.0, dtype=torch.float64),
                ]
            )

        return reduce

    assert fit_normalization(a, reduce_with(b)) == pytest.approx(fit_normalization(torch.cat([a, b])), rel=1e-12)


def test_fit_normalization_without_variance_only_centres_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        gain, bias = fit_normalization(torch.full((16,), 0.25), source="my.reward")
    assert (gain, bias) == (1.0, -0.25)
    assert len(caplog.records) == 1 and "no variance" in caplog.text and "my.reward" in caplog.text
    with caplog.at_level("WARNING"):
        assert fit_normalization(torch.zeros(8)) == (1.0, 0.0)  # a sparse reward never hit: no division by 0


def test_fit_normalization_leaves_out_non_finite_scores():
    raw = torch.tensor([0.0, float("nan"), 1.0, float("inf"), 2.0])
    assert fit_normalization(raw) == pytest.approx(fit_normalization(torch.tensor([0.0, 1.0, 2.0])))
    with pytest.raises(RewardError, match="every one of the 2 reference samples"):
        fit_normalization(torch.tensor([float("nan"), float("nan")]))


def test_the_rollout_applies_the_normalisation_and_keeps_the_raw_scores(tiny_lm_dir):
    from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer, make_reference
    from ppo_lightning.rewards.rules import char_fraction
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.algo.rollout import ScoreShaping
    from ppo_lightning.rollouts import Prompts, RolloutWorker
    from tests.helpers import play_and_score, shaped

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    enc = tok(["hello there", "a b c"], return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=6)
    out = {}
    for norm in ((1.0, 0.0), (4.0, -0.5)):
        worker = RolloutWorker(HFBackend(PolicyWithValueHead(lm).lm, tok), params, char_fraction, tok)
        played = play_and_score(
            worker,
            Prompts(enc.input_ids, enc.attention_mask),
            make_reference(lm),
            None,
            torch.Generator().manual_seed(0),
        )
        out[norm] = shaped(played, ScoreShaping(norm))
    plain, scaled = out[(1.0, 0.0)], out[(4.0, -0.5)]
    assert torch.equal(plain.scores, plain.raw_scores) and torch.equal(scaled.raw_scores, plain.raw_scores)
    torch.testing.assert_close(scaled.scores, 4.0 * plain.raw_scores - 0.5)


def test_a_reward_batch_decodes_once_and_only_when_a_reward_reads_text():
    """The batch's texts are decoded on first read and kept; ``completion_ids`` are built only
    when read (each row's response ids, pads left out); a reward that reads no text (the turns'
    rewards alone, a token-input reward model) never decodes."""
    from ppo_lightning.rewards.base import CallableReward, RewardBatch
    from ppo_lightning.rewards.environment import StepRewardsOnly

    class CountingTokenizer:
        pad_token_id = 0
        calls = 0

        def batch_decode(self, ids, skip_special_tokens=True):
            self.calls += 1
            return ["".join(chr(96 + t) for t in row.tolist() if t) for row in ids]

    tok = CountingTokenizer()
    ids = torch.tensor([[0, 1, 2, 3, 0], [4, 5, 6, 7, 8]])  # prompts of P=2 ("a" left-padded, "de"), then responses
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = RewardBatch(ids, mask, 2, tok)
    StepRewardsOnly().score(batch)
    assert tok.calls == 0 and "completion_ids" not in batch.__dict__
    assert batch.completion_ids == [[2, 3], [6, 7, 8]]
    total, applies, _ = CallableReward(lambda p, r: [float(len(r_)) for r_ in r]).score(batch)
    assert (batch.prompt_texts, batch.responses) == (["a", "de"], ["bc", "fgh"]) and tok.calls == 2
    assert total.tolist() == [2.0, 3.0] and applies.all()

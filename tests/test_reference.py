"""The frozen reference (ref.*): a copy of the initial policy by default, another model at
``ref.name_or_path``, or a lower-precision copy with ``ref.dtype``."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.jobs.factory import build_module, check_inputs
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.rollouts.forward import forward_logprobs
from ppo_lightning.models.tiny import save_tiny_causal_lm
from tests.conftest import compose_cfg

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv"]


def _logprobs(module, lm):
    tok = module.tokenizer
    enc = tok(["hello there, friend", "the cat sat"], return_tensors="pt", padding=True)
    ids = torch.cat([enc.input_ids, torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))], 1)
    am = torch.cat([enc.attention_mask, torch.ones(2, 6, dtype=torch.long)], 1)
    return forward_logprobs(None, lm, ids, am, position_ids_from_mask(am), enc.input_ids.shape[1], 1.0)[0]


def test_default_reference_is_a_frozen_copy_of_the_initial_policy(tmp_path, cache_dir):
    module, _ = build_module(compose_cfg(QUIET, tmp_path, cache_dir))
    ref, lm = module.ref_lm, module.policy.lm
    assert all(not p.requires_grad for p in ref.parameters())
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name  # equal values, own storage


def test_reference_from_another_model(tmp_path, cache_dir):
    other = save_tiny_causal_lm(tmp_path / "other-lm", seed=5)
    module, _ = build_module(compose_cfg([*QUIET, f"ref.name_or_path={other}"], tmp_path, cache_dir))
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(other)
    for (name, p), q in zip(expected.named_parameters(), module.ref_lm.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(_logprobs(module, module.ref_lm), _logprobs(module, module.policy.lm))


def test_reference_in_bfloat16_halves_its_memory_and_stays_close(tmp_path, cache_dir):
    module, _ = build_module(compose_cfg([*QUIET, "ref.dtype=bfloat16"], tmp_path, cache_dir))
    assert {p.dtype for p in module.ref_lm.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.policy.lm.parameters()} == {torch.float32}
    ref_bytes = sum(p.numel() * p.element_size() for p in module.ref_lm.parameters())
    policy_bytes = sum(p.numel() * p.element_size() for p in module.policy.lm.parameters())
    assert ref_bytes * 2 == policy_bytes
    # the reference's logprobs are the fp32 policy's up to bf16 rounding of weights and activations
    torch.testing.assert_close(
        _logprobs(module, module.ref_lm).float(), _logprobs(module, module.policy.lm), rtol=0, atol=0.1
    )


def test_reference_with_another_vocabulary_is_refused(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = save_tiny_causal_lm(tmp_path / "src-lm")
    wide = AutoModelForCausalLM.from_pretrained(src)
    wide.resize_token_embeddings(300)
    wide.save_pretrained(tmp_path / "wide-lm")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "wide-lm")
    with pytest.raises(ConfigError, match=r"^ref.name_or_path=.*wide-lm.*300 entries, the policy's 258"):
        build_module(compose_cfg([*QUIET, f"ref.name_or_path={tmp_path / 'wide-lm'}"], tmp_path, cache_dir))


def test_missing_reference_path_fails_before_anything_loads(tmp_path, cache_dir):
    cfg = compose_cfg([*QUIET, f"ref.name_or_path={tmp_path / 'nope'}"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"^ref.name_or_path=.*nope.*: no such directory"):
        check_inputs(cfg)

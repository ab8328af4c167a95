"""The generation interface: every caller samples through the configured backend, with the run's
one ``SamplingParams``."""

from __future__ import annotations

import pytest

from ppo_lightning.generation import SamplingParams
from tests.conftest import compose_cfg

RUN = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
    "logger=csv",
    "data.batch_size=8",
    "ppo.minibatch_size=8",
    "ppo.ppo_epochs=1",
    "sampling.max_new_tokens=8",
    "trainer.max_steps=2",
]


def test_every_sampler_goes_through_the_configured_backend_with_the_runs_params(tmp_path, cache_dir):
    """Reward normalisation samples the reference, each rollout and each evaluation (before
    training and after, the recipes' tables) the policy: all through ``generation._target_``, all
    with the one ``module.sampling`` (here with top-k and a stop string, which a caller rebuilding
    its own arguments could drop; an evaluation at the rollout's temperature samples with equal
    params); the backend gets the policy's weights after each iteration."""
    from ppo_lightning.jobs.factory import build
    from tests.helpers import RecordingBackend

    RecordingBackend.calls.clear()
    RecordingBackend.syncs.clear()
    cfg = compose_cfg(
        [
            *RUN,
            "generation._target_=tests.helpers.RecordingBackend",
            "sampling.top_k=5",
            "sampling.stop_strings=['xy']",
            "reward.normalize=true",
            "reward.normalize_samples=8",
            "eval.split_fraction=0.1",
            "eval.temperature=${sampling.temperature}",
            "eval.max_prompts=2",  # one batch: one call per evaluation
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    sampled = [
        "policy" if lm is module.policy.lm else "reference" if lm is module.ref_lm else "?"
        for lm, _ in RecordingBackend.calls
    ]
    assert sampled == ["reference", "policy", "policy", "policy", "policy"]  # normalisation, eval, 2 rollouts, eval
    assert all(params is module.sampling for _, params in RecordingBackend.calls[2:4])
    assert all(params == module.sampling for _, params in RecordingBackend.calls)
    assert module.sampling.top_k == 5 and module.sampling.stop_strings == ("xy",)
    assert RecordingBackend.syncs == [module.policy.lm] * 2  # the policy's backend, after each iteration


def test_sampling_params_come_from_the_sampling_node(tmp_path, cache_dir):
    cfg = compose_cfg(
        [
            "sampling.temperature=0.7",
            "sampling.top_p=0.9",
            "sampling.chunk_size=4",
            "sampling.stop_at_eos=false",
            "sampling.stop_token_ids=[5]",
        ],
        tmp_path,
        cache_dir,
    )
    from omegaconf import OmegaConf

    from ppo_lightning.jobs.factory import build_module

    module, _ = build_module(cfg)
    params = SamplingParams.from_config(OmegaConf.to_object(cfg.sampling), module.tokenizer)
    assert (
        params
        == module.sampling
        == SamplingParams(
            max_new_tokens=cfg.sampling.max_new_tokens,
            temperature=0.7,
            top_p=0.9,
            stop_at_eos=False,
            stop_token_ids=(5,),
            chunk_size=4,
        )
    )
    assert params.replace(greedy=True).greedy and not params.greedy


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("ppo.temperature", "sampling.temperature", "0.7"),
        ("ppo.rollout_generate_batch_size", "sampling.chunk_size", "4"),
        ("ppo.fast_decode", "generation.fast_decode", "false"),
    ],
)
def test_a_moved_sampling_key_fails_with_one_line_naming_its_new_home(tmp_path, cache_dir, old, new, value):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^{old} moved to {new}: write {new}=") as err:
        validate(compose_cfg([f"{old}={value}"], tmp_path, cache_dir))
    assert "\n" not in str(err.value)


def test_a_generation_node_without_a_target_names_the_key(tmp_path, cache_dir):
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.jobs.factory import build_module

    with pytest.raises(ConfigError, match=r"^generation: expected a mapping with a _target_"):
        build_module(compose_cfg(["~generation._target_"], tmp_path, cache_dir))


def test_generation_vllm_without_vllm_fails_before_any_model_loads_naming_generation(tmp_path, cache_dir):
    """Where vLLM is not installed, ``generation=vllm`` stops ``python train.py`` with one line
    that names the key and says how to install it, before any model is built."""
    import importlib.util

    from tests.helpers import run_train

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: tests/test_vllm.py covers generation=vllm")
    model_dir = cache_dir / "tiny-for-generation-vllm"  # model=tiny would build it here
    p = run_train(
        ["experiment=tiny_char", "generation=vllm", f"model.name_or_path={model_dir}", f"hydra.run.dir={tmp_path}"],
        cache_dir,
    )
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "generation=vllm" in ln]
    assert "vllm package cannot be imported" in line and "pip install" in line
    assert not model_dir.exists()


def test_the_vllm_sync_gathers_one_tensor_at_a_time_and_a_tied_one_once(monkeypatch):
    """What an FSDP rank sends its engine (``vllm._gathered``): each weight gathered whole only
    when the engine takes it, so a rank never holds a second whole copy of the policy; a tied
    weight (under two keys) is gathered once."""
    import torch

    import ppo_lightning.models.weights
    from ppo_lightning.generation.vllm import _gathered

    gathers = []

    def full_tensor(t):
        gathers.append(t)
        return t.clone()

    monkeypatch.setattr(ppo_lightning.models.weights, "full_tensor", full_tensor)
    emb, w = torch.randn(5, 3), torch.randn(3, 3)
    state = {"wte.weight": emb, "h.0.weight": w, "lm_head.weight": emb}
    stream = _gathered(state)
    name, first = next(stream)
    assert name == "wte.weight" and len(gathers) == 1  # nothing gathered ahead of the engine
    rest = dict(stream)
    assert [t.data_ptr() for t in gathers] == [emb.data_ptr(), w.data_ptr()]
    assert rest["lm_head.weight"] is first and torch.equal(rest["h.0.weight"], w)

"""LoRA (model.lora.*): the reference is the base model exactly, only adapters and the value head
train, the first update's ratio is 1, checkpoints hold what trains, and the export is a plain
merged model; on GPT-2-, Llama-, Qwen2- and GPT-NeoX-architecture tiny models."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.jobs.factory import build_module
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.generation.hf import generate
from ppo_lightning.rollouts.forward import forward_logprobs
from ppo_lightning.jobs.run import export, train
from tests.conftest import compose_cfg, read_metrics

ARCHS = ["gpt2", "llama", "qwen2", "gpt_neox"]
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv"]


def _overrides(arch: str, *extra: str) -> list[str]:
    return [
        *QUIET,
        "model.lora.r=4",
        f"model.build_tiny.arch={arch}",
        f"model.name_or_path=${{paths.cache_dir}}/tiny-{arch}-l2-h2-d64",
        *extra,
    ]


def _base_lm(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path).eval()


def _batch(module):
    tok = module.tokenizer
    enc = tok(["hello there, friend", "a", "the cat sat"], return_tensors="pt", padding=True)
    tail = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([enc.input_ids, tail], 1)
    am = torch.cat([enc.attention_mask, torch.ones(3, 6, dtype=torch.long)], 1)
    return ids, am, position_ids_from_mask(am), enc.input_ids.shape[1]


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_the_base_model_and_only_adapters_and_value_head_train(tmp_path, cache_dir, arch):
    cfg = compose_cfg(_overrides(arch), tmp_path, cache_dir)
    module, _ = build_module(cfg)
    lm = module.policy.lm
    for name, p in lm.named_parameters():  # adapters that change the output (B starts at 0)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(1))
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n or n.startswith("v_head.") for n in trainable)
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_A." in n}
    expected = {
        "gpt2": {"c_attn", "c_proj", "c_fc"},
        "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
        "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    }
    expected["qwen2"] = expected["llama"]
    assert adapted == expected[arch]  # every linear layer but the output head
    assert sum(p.numel() for p in module.ref_lm.parameters()) == 0  # no second copy of the weights

    ids, am, pos, P = _batch(module)
    base = _base_lm(cfg)
    ref_logp, _ = forward_logprobs(None, module.ref_lm, ids, am, pos, P, 1.0)
    base_logp, _ = forward_logprobs(None, base, ids, am, pos, P, 1.0)
    policy_logp, _ = forward_logprobs(None, lm, ids, am, pos, P, 1.0)
    torch.testing.assert_close(ref_logp, base_logp, rtol=0, atol=1e-6)
    assert (policy_logp - base_logp).abs().max() > 1e-2  # the adapters are on for the policy
    # the reference samples through the same view: the base model's greedy tokens
    kw = dict(
        max_new_tokens=6,
        eos_token_id=module.tokenizer.eos_token_id,
        pad_token_id=module.tokenizer.pad_token_id,
        greedy=True,
        stop_at_eos=False,
    )
    assert torch.equal(
        generate(module.ref_lm, ids[:, :P], am[:, :P], **kw)[0], generate(base, ids[:, :P], am[:, :P], **kw)[0]
    )
    # and the adapters are back on afterwards
    torch.testing.assert_close(forward_logprobs(None, lm, ids, am, pos, P, 1.0)[0], policy_logp)


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_run_checkpoint_and_merged_export(tmp_path, cache_dir, arch):
    """Two iterations, one update each over the whole batch (the first update's ratio is exactly
    1), then: the base weights are untouched, the checkpoint holds adapters, value head and
    optimizer state only, and the merged export loads in plain transformers with the policy's
    logits, as does the adapter directory through peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = compose_cfg(
        _overrides(
            arch,
            "trainer.max_steps=2",
            "ppo.ppo_epochs=1",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "sampling.max_new_tokens=8",
            "callbacks.model_checkpoint.every_n_train_steps=2",
        ),
        tmp_path,
        cache_dir,
    )
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert rows[0]["val/ratio"] == pytest.approx(1.0, abs=1e-6) and rows[0]["policy/approxkl_avg"] == pytest.approx(
        0, abs=1e-7
    )
    assert rows[0]["objective/kl"] == 0 and rows[1]["objective/kl"] != 0  # the adapters moved the policy

    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    params = list(ckpt["state_dict"])
    assert params and all(".lora_" in k or k.startswith("policy.v_head.") for k in params), params[:5]
    n_trainable = len(ckpt["state_dict"])
    assert len(ckpt["optimizer_states"][0]["state"]) == n_trainable  # Adam moments of exactly those

    module, _ = build_module(compose_cfg(_overrides(arch), tmp_path / "reload", cache_dir))
    module.load_state_dict(ckpt["state_dict"], strict=False)
    base = _base_lm(cfg)
    frozen = {n.replace(".base_layer.", "."): p for n, p in module.policy.lm.named_parameters() if ".lora_" not in n}
    for name, p in base.named_parameters():  # the frozen base weights are the source's
        assert torch.equal(frozen[name], p), name

    ids, am, pos, P = _batch(module)
    policy_logp, _ = forward_logprobs(None, module.policy.lm, ids, am, pos, P, 1.0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    torch.testing.assert_close(
        forward_logprobs(None, merged, ids, am, pos, P, 1.0)[0], policy_logp, rtol=1e-5, atol=1e-5
    )
    adapter = PeftModel.from_pretrained(_base_lm(cfg), str(tmp_path / "policy" / "adapter")).eval()
    torch.testing.assert_close(
        forward_logprobs(None, adapter.get_base_model(), ids, am, pos, P, 1.0)[0], policy_logp, rtol=1e-5, atol=1e-5
    )
    assert (tmp_path / "policy" / "value_head.safetensors").exists()

    if arch == "gpt2":  # task=export from the checkpoint writes the same merged model
        export(
            compose_cfg(
                _overrides(
                    arch,
                    "task=export",
                    f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
                    f"export_dir={tmp_path / 'exported'}",
                ),
                tmp_path / "export_run",
                cache_dir,
            )
        )
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
        torch.testing.assert_close(
            forward_logprobs(None, again, ids, am, pos, P, 1.0)[0], policy_logp, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.lora.dropout=0.05"], r"^model.lora.dropout was removed: PPO needs logprobs that are a deterministic"),
        (["ref.dtype=bfloat16"], r"^ref.dtype='bfloat16' with model.lora.r=4: with LoRA the reference is the policy"),
        (["ref.name_or_path=/tmp"], r"^ref.name_or_path='/tmp' with model.lora.r=4"),
    ],
)
def test_lora_config_errors(tmp_path, cache_dir, overrides, match):
    from ppo_lightning.config import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(_overrides("gpt2", *overrides), tmp_path, cache_dir))


def test_unknown_target_modules_name_the_key_and_the_layers(tmp_path, cache_dir):
    cfg = compose_cfg(_overrides("llama", "model.lora.target_modules=[c_attn]"), tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules=\['c_attn'\]: .*q_proj"):
        build_module(cfg)

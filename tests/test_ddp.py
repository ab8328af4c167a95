"""Two CPU processes under DDP (gloo): the run completes and both ranks hold identical weights."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics
from tests.helpers import run_ranks
from tests.test_cli import TINY_RUN

pytestmark = pytest.mark.slow  # two processes per run


_RUNS: dict[tuple[str, ...], dict] = {}


def shared_ddp_run(tmp_path_factory, cache_dir, name: str, extra: list[str]) -> dict:
    """``ddp_run``, each distinct run made once per module and shared by the tests that read it."""
    if tuple(extra) not in _RUNS:
        _RUNS[tuple(extra)] = ddp_run(tmp_path_factory.mktemp(name), cache_dir, name, extra)
    return _RUNS[tuple(extra)]


def ddp_run(tmp_path, cache_dir, name: str, extra: list[str]) -> dict:
    """``trainer=ddp_cpu`` for a few iterations, in ``tmp_path/run_<name>``; the ranks' final
    policy weights must be identical (returned once, with the run's metrics rows)."""
    weights = tmp_path / name
    p = run_ranks(
        [
            "trainer=ddp_cpu",
            *TINY_RUN,
            "optimizer.lr=1e-3",
            *extra,
            f"hydra.run.dir={tmp_path / ('run_' + name)}",
            "+callbacks.rank_weights._target_=tests.helpers.SaveRankWeights",
            f"+callbacks.rank_weights.dir={weights}",
        ],
        cache_dir,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    w0 = torch.load(weights / "rank0.pt", weights_only=True)
    w1 = torch.load(weights / "rank1.pt", weights_only=True)
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), (name, k)
    return {"weights": w0, "rows": read_metrics(tmp_path / ("run_" + name) / "metrics.csv")}


def test_ddp_cpu_two_ranks_end_with_identical_weights(cache_dir, tmp_path_factory):
    run = shared_ddp_run(tmp_path_factory, cache_dir, "whole", ["trainer.max_steps=2"])
    # the weights moved, so the ranks agree on an update, not just on the initialisation
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-gpt2-l2-h2-d64").state_dict()
    assert not torch.equal(
        init["transformer.h.0.attn.c_attn.weight"], run["weights"]["lm.transformer.h.0.attn.c_attn.weight"]
    )
    assert [r["episode"] for r in run["rows"]] == [16.0, 32.0]  # 8 prompts x 2 ranks per iteration


def test_ddp_micro_batches_all_reduce_once_and_give_the_same_update(cache_dir, tmp_path_factory):
    """Micro-batches under DDP: the non-last micro-batches accumulate without an all-reduce
    (``no_sync``), the last one all-reduces the accumulated gradient. Ranks end identical, and equal
    the unsplit DDP run's weights within fp32 tolerance."""
    whole = shared_ddp_run(tmp_path_factory, cache_dir, "whole", ["trainer.max_steps=2"])["weights"]
    micro = shared_ddp_run(tmp_path_factory, cache_dir, "micro", ["trainer.max_steps=2", "ppo.micro_batch_size=2"])[
        "weights"
    ]
    for k in whole:
        torch.testing.assert_close(micro[k], whole[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_lora_ranks_train_identical_adapters(cache_dir, tmp_path_factory):
    """LoRA under DDP: only the adapters and the value head are in the gradient all-reduce, the
    ranks end with identical adapters that moved, and the frozen base is untouched."""
    run = shared_ddp_run(tmp_path_factory, cache_dir, "lora", ["trainer.max_steps=2", "model.lora.r=4"])
    w = run["weights"]
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-gpt2-l2-h2-d64").state_dict()
    assert torch.equal(
        init["transformer.h.0.attn.c_attn.weight"], w["lm.transformer.h.0.attn.c_attn.base_layer.weight"]
    )
    assert w["lm.transformer.h.0.attn.c_attn.lora_B.default.weight"].abs().sum() > 0  # B starts at 0


def test_ddp_global_token_mean_keeps_ranks_identical_and_changes_the_update(cache_dir, tmp_path_factory):
    """``ppo.loss_agg=token_mean_global`` under ``trainer=ddp_cpu``: the ranks' responses differ in
    length, so dividing each rank's token sum by the mean count over ranks (not its own count)
    gives another update than the per-rank ``token_mean``, and the ranks still end identical.
    (``tests/test_loss_options.py`` checks the gradient against one process's global mean.)"""
    from transformers import AutoModelForCausalLM

    # a quarter of the byte vocabulary stops a response: the ranks' lengths differ on any seed
    ragged = ["trainer.max_steps=2", f"sampling.stop_token_ids=[{','.join(map(str, range(0, 256, 4)))}]"]
    local = shared_ddp_run(tmp_path_factory, cache_dir, "ragged", ragged)["weights"]
    pooled = shared_ddp_run(tmp_path_factory, cache_dir, "global", [*ragged, "ppo.loss_agg=token_mean_global"])[
        "weights"
    ]
    init = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-gpt2-l2-h2-d64").state_dict()
    key = "transformer.h.0.attn.c_attn.weight"
    update_local, update_pooled = local["lm." + key] - init[key], pooled["lm." + key] - init[key]
    # not one element off: the updates differ by 0.9% of their size (Adam's step is nearly
    # scale-free), 10^4 times what float noise could give
    assert (update_pooled - update_local).norm() > 1e-3 * update_local.norm(), (
        (update_pooled - update_local).norm(),
        update_local.norm(),
    )

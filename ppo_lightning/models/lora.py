"""LoRA through ``peft``: low-rank adapters on the policy's linear layers, and the reference as the
same network with its adapters switched off.

Why the reference costs nothing here: LoRA leaves the base weights frozen, so the initial policy
is the base model, exactly. ``DisabledAdapters`` runs the policy's own LM with every adapter off,
which is the frozen reference with no second copy of the weights (full fine-tuning keeps a copy:
``policy.make_reference``). Only the adapters and the value head train; checkpoints hold those
(the frozen base weights are rebuilt from ``model.name_or_path``), and export merges the adapters
into the base weights (``merged_state_dict``), so the exported directory is a plain model.

``peft`` is an optional extra (``pip install -e ".[lora]"``); it is imported only when
``model.lora.r > 0``.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch import nn

from ppo_lightning.config.errors import ConfigError

ALL_LINEAR = "all-linear"  # model.lora.target_modules=null: every linear layer but the output head
ADAPTER_DIR = "adapter"  # export_dir/adapter: the adapters alone, for peft's PeftModel.from_pretrained


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(
            'model.lora.r > 0 needs peft: pip install -e ".[lora]" (or pip install peft), '
            "or set model.lora.r=0 for full fine-tuning"
        ) from None
    return peft


def apply_lora(lm: nn.Module, r: int, alpha: float, target_modules: list[str] | None):
    """Inject LoRA adapters into ``lm`` in place (its base weights frozen); returns the peft model
    that wraps it (for ``disable_adapter`` and ``save_pretrained``).

    ``target_modules`` null: peft's ``all-linear``, every ``nn.Linear`` / GPT-2 ``Conv1D`` of the
    model except the output head, found per architecture (GPT-2: c_attn, c_proj, c_fc; Llama and
    Qwen2: q/k/v/o_proj, gate/up/down_proj; GPT-NeoX: query_key_value, dense, dense_h_to_4h,
    dense_4h_to_h). Adapting every linear layer is what matches full fine-tuning best (QLoRA).
    No dropout on the adapters: PPO's logprobs must be a deterministic function of the weights.
    """
    peft = _peft()
    from transformers.pytorch_utils import Conv1D

    targets = list(target_modules) if target_modules else ALL_LINEAR
    conv1d = any(isinstance(m, Conv1D) for m in lm.modules())  # GPT-2 stores W as [in, out]
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets,
        fan_in_fan_out=conv1d,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers by a name it deprecates
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = peft.get_peft_model(lm, config)
    except ValueError as e:
        if target_modules:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, (nn.Linear, Conv1D))})
            raise ConfigError(
                f"model.lora.target_modules={list(target_modules)}: {e}. Linear layers of "
                f"{type(lm).__name__}: {names}; null adapts all but the output head"
            ) from None
        raise
    return peft_model


class DisabledAdapters(nn.Module):
    """The policy's LM with its LoRA adapters switched off for the length of each call: the frozen
    reference (the initial policy, since LoRA never changes the base weights), with no second copy.

    The LM is held outside the module tree (its weights are the policy's, trained and saved there),
    so this module has no parameters of its own. Each call runs in eval mode: a policy that
    checkpoints keeps its LM in train mode, where Hugging Face would turn the KV cache off.
    """

    def __init__(self, peft_model):
        super().__init__()
        self.__dict__["peft_model"] = peft_model  # not submodules: see the class docstring
        self.__dict__["lm"] = peft_model.get_base_model()

    @property
    def config(self):
        return self.lm.config

    @property
    def generation_config(self):
        return self.lm.generation_config

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, *args, **kwargs):
        lm = self.lm
        was_training = lm.training
        if was_training:
            lm.eval()
        try:
            with self.peft_model.disable_adapter():
                return lm(*args, **kwargs)
        finally:
            if was_training:
                lm.train()


def merged_state_dict(lm: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``lm``'s state dict with every adapter merged into its base weight, W + (B·A)·alpha/r
    (transposed for GPT-2's ``Conv1D``, which stores W as [in, out]: peft's ``get_delta_weight``
    for the plain LoRA that ``apply_lora`` configures), under the plain model's key names: what
    ``save_pretrained(state_dict=...)`` writes for ``AutoModelForCausalLM.from_pretrained``.

    ``state``: ``lm``'s state dict as whole tensors, when ``lm`` itself holds shards (FSDP: the
    gathered ``full_state_dict``); by default ``lm.state_dict()``. Nothing in ``lm`` changes:
    merging in place and unmerging afterwards would leave W + Δ − Δ, which is not W in floating
    point, and W is also the reference."""
    from peft.tuners.lora import LoraLayer

    state = lm.state_dict() if state is None else state
    deltas = {}
    for name, m in lm.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        delta = 0
        for a in m.active_adapters:
            A, B = state[f"{name}.lora_A.{a}.weight"].float(), state[f"{name}.lora_B.{a}.weight"].float()
            delta = delta + (B @ A) * m.scaling[a]
        deltas[name] = delta.T if m.fan_in_fan_out else delta
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        module, sep, rest = key.partition(".base_layer.")
        if sep:
            key = f"{module}.{rest}"
            if rest == "weight":
                value = (value.float() + deltas[module]).to(value.dtype)
        merged[key] = value.detach()
    return merged


@contextlib.contextmanager
def _quiet_peft_warnings():
    with warnings.catch_warnings():
        # the pad token added to the vocabulary resized the embeddings: peft saves them with the
        # adapter, which is what loading the adapter onto the base model needs
        warnings.filterwarnings("ignore", message=".*embedding.*")
        yield


def save_adapter(peft_model, directory: str | Path, lm_state: dict[str, torch.Tensor] | None = None) -> Path:
    """The adapters alone (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
    ``peft.PeftModel.from_pretrained(base_model, directory)``. ``lm_state``: the LM's whole state
    dict, when the model holds shards (FSDP); peft picks the adapters' entries from it."""
    directory = Path(directory)
    if lm_state is not None:  # peft's keys are the wrapper's: base_model.model.<the LM's>
        lm_state = {f"base_model.model.{k}": v for k, v in lm_state.items()}
    with _quiet_peft_warnings():
        peft_model.save_pretrained(str(directory), state_dict=lm_state)
    return directory


def underlying(lm: nn.Module) -> nn.Module:
    """The module a call to ``lm`` runs: for a ``lora.DisabledAdapters`` view (the LoRA policy's
    own LM with its adapters off, the reference under LoRA) that LM, else ``lm`` itself. The
    one place that sees through the wrappers this project makes; peft's own wrapper is unwrapped
    once, when the view is made (``get_base_model``)."""
    return lm.lm if isinstance(lm, DisabledAdapters) else lm

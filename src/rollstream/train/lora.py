"""LoRA through peft: the policy wrapped with an adapter, what weight sync sends of it, and
its checkpoint folder.

The trainer trains the adapter alone (the base weights are frozen, so AdamW holds state for
the adapter only); the reference policy of a KL term is the same module with the adapter
disabled, so no second model is held. Weight sync sends the adapter alone, as the
``adapter`` payload of ``sync/protocol.py``: peft's ``lora_A`` and ``lora_B`` per adapted
layer under the base layer's Hugging Face name, B multiplied by peft's scale (``alpha /
rank``), so a receiver needs no adapter config to merge it. A checkpoint is peft's own
folder (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
``PeftModel.from_pretrained`` onto the run's base model, whose absolute path it records.

Deliberately simplified: one adapter (peft's ``default``), on the linear layers named by
``model.lora.target_modules``; no MoE expert targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollstream.sync.protocol import ADAPTER_FILE, ADAPTER_SUFFIXES, PEFT_PREFIX

if TYPE_CHECKING:
    from peft import PeftModel

    from rollstream.config.model import LoraConfig

ADAPTER = "default"  # peft's name of the one adapter


def wrap(model: torch.nn.Module, cfg: LoraConfig, base_path: Path) -> PeftModel:
    """``model`` with a fresh adapter (B = 0: the wrapped model computes what ``model``
    did); its base weights frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as e:  # an optional extra
        raise ImportError("model.lora needs peft: pip install 'rollstream[lora]'") from e
    if getattr(model.config, "num_experts", 0):  # the engine's merge knows dense names only
        raise ValueError("model.lora on a mixture-of-experts model is not supported yet: "
                         "train it without model.lora")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none",
                              task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, peft_cfg)
    # recorded in adapter_config.json: from_pretrained finds the base from any folder
    wrapped.peft_config[ADAPTER].base_model_name_or_path = str(Path(base_path).resolve())
    return wrapped


def sync_tensors(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter as weight sync sends it (module docstring): new tensors (B scaled), A
    the live parameter's storage."""
    from peft.tuners.lora import LoraLayer

    a_end, b_end = ADAPTER_SUFFIXES
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        hf_name = name.removeprefix(PEFT_PREFIX)
        out[hf_name + a_end] = module.lora_A[ADAPTER].weight.detach()
        out[hf_name + b_end] = module.lora_B[ADAPTER].weight.detach() * module.scaling[ADAPTER]
    return out


def load_adapter(model: PeftModel, folder: Path) -> None:
    """Set the adapter's weights to those of the peft folder ``folder`` (a checkpoint of
    this run); ValueError when it adapts other layers or shapes."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise ValueError(f"{folder} holds no LoRA adapter ({ADAPTER_FILE}): not a "
                         "checkpoint of a model.lora run")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path} does not fit this adapter (missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]})")

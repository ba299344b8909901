"""A LoRA run's model folders: peft's adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, what ``train/lora.py`` saves) read as the merged causal LM it
describes, for the final check and ``rollstream export``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.models.folder import ADAPTER_CONFIG

if TYPE_CHECKING:
    import torch


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def load_merged(folder: Path, dtype: torch.dtype | str = "auto") -> torch.nn.Module:
    """The base model ``folder``'s ``adapter_config.json`` names (``base_model_name_or_path``)
    with the adapter merged into its weights: a plain HF causal LM."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base_path = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    if not base_path or not Path(base_path).is_dir():
        raise ValueError(f"{folder}/adapter_config.json: its base model {base_path!r} is not a "
                         "folder here (the adapter is merged onto it)")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()


def save_merged(folder: Path, out: Path, dtype: torch.dtype | str = "auto") -> Path:
    """Write the merged model of the adapter folder ``folder`` to ``out`` as a plain HF folder
    (config, safetensors), with ``folder``'s tokenizer files and generation config."""
    import shutil

    from rollstream.models.tokenizer import copy_tokenizer_files

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    load_merged(folder, dtype).save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer_files(Path(folder), out)
    if (gen := Path(folder) / "generation_config.json").is_file():
        shutil.copy2(gen, out / gen.name)
    return out

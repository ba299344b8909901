"""Is a folder a Hugging Face causal-LM folder the run can load? Checked before anything else.

The engines and the trainer read ``config.json`` (a JSON object transformers can read),
``tokenizer.json`` (the fast tokenizer: without it transformers falls back to the model
type's own tokenizer class, which for a kit folder loads a 5-token vocabulary that encodes
every prompt to nothing) and the weights: ``*.safetensors`` files, each header parsed and its
tensors covering the file exactly (a truncated or garbage file fails here; a sharded folder's
``model.safetensors.index.json`` must name shards that are there), or ``pytorch_model*.bin``.
A LoRA run's checkpoints are peft adapter folders: ``adapter_config.json`` (a JSON object)
stands for ``config.json`` there, and ``adapter_model.safetensors`` is checked as weights.
:func:`validate_model_folder` raises a ValueError naming the setting and the file, so a run
fails before it touches its run directory and a resume before it reconciles the ledger.

Simplifications: a bit flip inside tensor data is not found (safetensors has no checksum);
``.bin`` weights are only required to exist (reading them means unpickling the whole file).
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's; its weights are adapter_model.safetensors


def validate_model_folder(path: Path, what: str = "model.path") -> Path:
    """``path`` resolved if it holds a loadable HF causal-LM folder; a ValueError naming
    ``what`` (the setting, or the checkpoint) and the file at fault otherwise."""
    problem = model_folder_problem(Path(path))
    if problem is not None:
        raise ValueError(f"{what} {str(path)!r}: {problem}")
    return Path(path).resolve()


def model_folder_problem(path: Path) -> str | None:
    """Why ``path`` is not a loadable model folder (naming the file), or None."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a folder (expected a Hugging Face model folder)"
    return _config_problem(path) or _tokenizer_problem(path) or _weights_problem(path)


def _config_problem(path: Path) -> str | None:
    config = path / CONFIG
    if not config.is_file() and (path / ADAPTER_CONFIG).is_file():
        return _json_problem(path / ADAPTER_CONFIG)  # a LoRA run's checkpoint: an adapter
    if not config.is_file():
        return f"has no {CONFIG} (not a Hugging Face model folder)"
    problem = _json_problem(config)
    if problem is not None:
        return problem
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - fault boundary: whatever transformers says, named
        return f"{config}: transformers cannot read it ({type(e).__name__}: {e})"
    return None


def _tokenizer_problem(path: Path) -> str | None:
    file = path / TOKENIZER
    if not file.is_file():
        return (f"has no {TOKENIZER} (the run loads the fast tokenizer from it; save one with "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exceptions
        return f"{file}: not a tokenizer the tokenizers library can load ({e})"
    from rollstream.models.tokenizer import is_legacy_kit_tokenizer

    if is_legacy_kit_tokenizer(path):
        return (f"{file}: the character tokenizer of an earlier rollstream kit, which "
                "AutoTokenizer (and so vLLM) reads without spaces and newlines; build the tiny "
                "model again (leave model.path unset) and train it again")
    return None


def _weights_problem(path: Path) -> str | None:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        problem = _json_problem(index)
        if problem is not None:
            return problem
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            return f"{index}: has no weight_map object"
        missing = sorted({str(f) for f in weight_map.values()
                          if not (path / str(f)).is_file()})
        if missing:
            return f"{index}: names shards that are not in the folder: {missing}"
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not any(path.glob("pytorch_model*.bin")):
        return "has no weights (model.safetensors, its shards, or pytorch_model.bin)"
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="numpy") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            return f"{shard}: not a whole safetensors file ({e})"
    return None


def _json_problem(file: Path) -> str | None:
    """Why ``file`` is not a JSON object, naming it, or None."""
    try:
        loaded = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        return f"{file}: not valid JSON ({e})"
    if not isinstance(loaded, dict):
        return f"{file}: expected a JSON object, got {type(loaded).__name__}"
    return None

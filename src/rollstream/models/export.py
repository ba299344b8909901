"""``rollstream export``: a run's model folder, written for other tools and checked.

The source is the run's final checkpoint (``RUN/checkpoint``) or a durable checkpoint's
``model`` folder (``--step N``); a LoRA run's (a peft adapter folder) is exported merged onto
its base model. The export holds the weights (safetensors, optionally cast
to another dtype), ``config.json``, ``generation_config.json`` (stopping at end-of-text and
the chat template's end-of-turn token) and the tokenizer files copied byte for byte. It is
checked as :mod:`rollstream.models.folder_check` describes (tokenizer and model round trip);
a failed check raises, naming the folder, which is left for inspection. docs/export.md says
how to use the folder with HF ``generate`` and a vLLM server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rollstream.durable import checkpoint as durable
from rollstream.models.adapter import is_adapter_folder, load_merged
from rollstream.models.folder_check import Tie
from rollstream.run_files import RunFiles

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True, kw_only=True, frozen=True)
class Exported:
    """What :func:`export_run` wrote and how its check went."""

    folder: Path
    source: Path
    dtype: str
    num_prompts: int  # greedy generations compared by the model round trip
    ties: tuple[Tie, ...]  # accepted near ties where the two decoders parted
    check_s: float  # seconds the two checks took


def source_folder(run_dir: Path, step: int | None) -> Path:
    """The model folder of ``run_dir``: its final checkpoint, or checkpoint ``step``'s."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    if step is None:
        final = RunFiles(run_dir).final_checkpoint
        if not ((final / "config.json").is_file() or is_adapter_folder(final)):
            raise ValueError(f"{run_dir} has no final checkpoint ({final}); steps with a "
                             f"durable checkpoint: {durable.steps(run_dir) or 'none'} "
                             "(--step N)")
        return final
    try:
        return durable.at_step(run_dir, step).model_dir
    except ValueError as e:
        raise ValueError(f"--step {step}: {e}") from None


def export_run(run_dir: Path, *, out: Path, step: int | None = None,
               dtype: str | None = None, threads: int = 0) -> Exported:
    """Write ``run_dir``'s model folder (module docstring) into ``out`` (new or empty), in
    ``dtype`` (None: as saved), and check it (``threads``: as ``check_model`` takes them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.models.folder_check import (
        check_model,
        check_tokenizer,
        probe_prompts,
        write_stop_tokens,
    )
    from rollstream.models.tokenizer import copy_tokenizer_files, is_legacy_kit_tokenizer

    if threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {threads}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    src = source_folder(run_dir, step)
    if is_legacy_kit_tokenizer(src):
        raise ValueError(f"{src} holds the character tokenizer of an earlier rollstream kit, "
                         "which AutoTokenizer reads without spaces and newlines: it cannot be "
                         "exported faithfully (train the model again)")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty folder")
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    as_dtype = getattr(torch, dtype) if dtype is not None else "auto"
    model = (load_merged(src, as_dtype) if is_adapter_folder(src)  # a LoRA run's: merged
             else AutoModelForCausalLM.from_pretrained(str(src), dtype=as_dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    saved_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    del model
    copy_tokenizer_files(src, out)
    write_stop_tokens(out, tokenizer)
    t0 = time.perf_counter()
    check_tokenizer(out, tokenizer)
    prompts = probe_prompts(tokenizer)
    ties = check_model(out, prompts, threads=threads)
    return Exported(folder=out, source=src, dtype=saved_dtype, num_prompts=len(prompts),
                    ties=tuple(ties), check_s=time.perf_counter() - t0)

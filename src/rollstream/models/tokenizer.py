"""The tiny-model kit's tokenizer: one token per ASCII byte, saved as an ordinary Qwen2 tokenizer.

The vocabulary is four special tokens (ids 0..3: pad, eos, ``<|im_start|>``, ``<|im_end|>``)
and the 128 ASCII bytes in byte order (id ``4 + byte``), each under its GPT-2 byte-level
symbol (space is ``Ġ``, newline ``Ċ``), with no merges: one token per character of
:data:`ALPHABET` (the characters the synthetic tasks use) and of any ASCII text. Any sequence
of ids decodes to text that encodes back to the same ids, so a model's turn can be rendered
again exactly (the agent loop's alignment check relies on it).

It is a ``transformers`` ``Qwen2Tokenizer`` (byte-level BPE: NFC normaliser, Qwen2's split
pattern, byte-level pre-tokenizer and decoder) because transformers 5's ``AutoTokenizer``
builds that class for every folder whose config.json says ``qwen2``, whatever
``tokenizer_config.json`` names, from the vocabulary and merges alone (an earlier kit's
character vocabulary lost every space and newline that way). A vocabulary of byte symbols is
one it rebuilds faithfully: a folder written here loads the same way in ``AutoTokenizer``,
vLLM, TRL or any other tool, in a process that never imports rollstream
(tests/models/test_export.py). A Llama folder's ``tokenizer_config.json`` names
``Qwen2Tokenizer`` too.

Simplifications: ASCII only, and no unknown token (Qwen2's tokenizer class has none): a
character outside ASCII encodes to nothing, in the kit as in every tool reading its folder.
No merges and no BOS/EOS post-processor: encoding a prompt adds nothing, the task decides
where the EOS goes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import Qwen2Tokenizer

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END)

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n#=/+-*()?:.,"

# what a model folder's tokenizer may be saved as (any family): copied as they are
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ascii_symbols() -> list[str]:
    """GPT-2's byte-level symbols of the bytes 0..127: printable ones stand for themselves,
    the others (controls, space, DEL) take the code points from 256 upwards in byte order, as
    ``tokenizers``' ByteLevel pre-tokenizer maps them."""
    shifted = iter(range(256, 512))
    return [chr(b) if ord("!") <= b <= ord("~") else chr(next(shifted)) for b in range(128)]


def build_char_tokenizer() -> Qwen2Tokenizer:
    """The kit tokenizer: special tokens take ids 0..3 (pad 0, eos 1), then one id per ASCII
    byte."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ascii_symbols()))}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        pad_token=PAD,
        eos_token=EOS,
        unk_token=None,  # as Qwen2Tokenizer rebuilds it (module docstring)
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 20,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy ``src``'s tokenizer files (:data:`TOKENIZER_FILES`) into ``dst`` byte for byte:
    a folder's tokenizer is never re-saved, so what other tools read is what training read."""
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


def is_legacy_kit_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds the character tokenizer earlier kits saved (a WordLevel model
    behind a one-character Split), which ``AutoTokenizer`` misreads for a Qwen2 folder: it
    drops every space and newline."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("model", {}).get("type") == "WordLevel" and pre.get("type") == "Split"
            and pre.get("pattern") == {"Regex": r"[\s\S]"})

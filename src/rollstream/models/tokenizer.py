"""The tiny-model kit's character-level tokenizer, saved as an ordinary Hugging Face fast tokenizer.

One token per character of a small alphabet (digits, letters, space, newline and the
punctuation the synthetic tasks use) plus five special tokens. It is built with the
``tokenizers`` library (a WordLevel model behind a one-character Split pre-tokenizer and a Fuse
decoder) and wrapped in ``transformers.PreTrainedTokenizerFast``; :func:`load_tokenizer` loads
a saved folder, kit or not, chat template included. (transformers 5's ``AutoTokenizer``
gives a kit folder the model type's own tokenizer class, whose byte-level pre-tokenizer
silently drops spaces and newlines from this vocabulary when encoding: load through
:func:`load_tokenizer`.)

Simplifications: no byte fallback (a character outside the alphabet becomes ``<|unk|>``), no
normalisation, and no BOS/EOS post-processor: encoding a prompt adds nothing, the task decides
where the EOS goes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n#=/+-*()?:.,"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The kit tokenizer: special tokens take ids 0..4 (pad 0, eos 1), then the alphabet."""
    if len(set(ALPHABET)) != len(ALPHABET):
        raise AssertionError("duplicate character in ALPHABET")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "[\\s\\S]" matches every single character, newline included (Oniguruma syntax).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 20,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def save_char_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Build the kit tokenizer and save it into ``out_dir`` (created if needed)."""
    tokenizer = build_char_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def is_kit_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds the kit's character tokenizer (by its ``tokenizer.json``)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("model", {}).get("type") == "WordLevel" and pre.get("type") == "Split"
            and pre.get("pattern") == {"Regex": r"[\s\S]"})


def load_tokenizer(folder: str | Path, **kwargs: Any) -> Any:
    """The tokenizer of a model folder: the kit's exactly as saved, any other with
    ``AutoTokenizer`` (module docstring)."""
    from transformers import AutoTokenizer

    if is_kit_tokenizer(Path(folder)):
        return PreTrainedTokenizerFast.from_pretrained(str(folder), **kwargs)
    return AutoTokenizer.from_pretrained(str(folder), **kwargs)

"""The kit tokenizer: character round trip, specials, chat template, loaded by AutoTokenizer
from a tokenizer folder and from model folders of both architectures (transformers 5 builds
Qwen2's own tokenizer class for a qwen2 folder; tests/models/test_export.py checks the same in
a process that never imports rollstream)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollstream.config.schema import TinyModelConfig
from rollstream.models.folder_check import save_char_tokenizer
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import (
    ALPHABET,
    EOS,
    IM_END,
    IM_START,
    PAD,
    build_char_tokenizer,
    is_legacy_kit_tokenizer,
)


@pytest.fixture(scope="module", params=["tokenizer", "qwen2", "llama"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "tokenizer":
        save_char_tokenizer(folder)
    else:
        cfg = TinyModelConfig(arch=request.param, hidden_size=16, num_layers=1, num_heads=2,
                              num_kv_heads=1, intermediate_size=32, max_position=32)
        build_tiny_model(cfg, build_char_tokenizer(), folder)
    assert not is_legacy_kit_tokenizer(folder)
    return folder


def load_tokenizer(folder: Path):
    return AutoTokenizer.from_pretrained(str(folder))


def test_vocab_is_small_and_one_token_per_character() -> None:
    tok = build_char_tokenizer()
    assert len(tok) == 4 + 128  # the special tokens and one per ASCII byte
    for ch in ALPHABET:
        assert len(tok.encode(ch, add_special_tokens=False)) == 1, repr(ch)
    assert len({tok.encode(ch, add_special_tokens=False)[0] for ch in ALPHABET}) == len(ALPHABET)


def test_round_trip_keeps_every_character(saved: Path) -> None:
    tok = load_tokenizer(saved)
    text = ALPHABET + "T517#07= 517/07 518/06\n12+7*3=(33)?:.,"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_special_tokens_and_their_ids(saved: Path) -> None:
    tok = load_tokenizer(saved)
    assert tok.eos_token == EOS and tok.pad_token == PAD
    assert tok.eos_token_id != tok.pad_token_id
    for special in (PAD, EOS, IM_START, IM_END):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]
    ids = tok.encode("33", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=False) == "33" + EOS
    assert tok.decode(ids, skip_special_tokens=True) == "33"


def test_encoding_a_prompt_adds_no_special_tokens(saved: Path) -> None:
    tok = load_tokenizer(saved)
    plain = tok.encode("T517#07=", add_special_tokens=False)
    assert tok.encode("T517#07=") == plain
    assert tok("T517#07=")["input_ids"] == plain
    assert tok.bos_token_id is None
    assert tok.eos_token_id not in plain


def test_ascii_is_one_token_per_byte_and_any_ids_decode_to_text_that_encodes_back(
        saved: Path) -> None:
    tok = load_tokenizer(saved)
    text = "".join(map(chr, range(128)))
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [4 + b for b in range(128)]
    assert tok.decode(ids) == text
    every = list(range(len(tok))) * 2  # specials and bytes, in any order: rendered again exactly
    assert tok.encode(tok.decode(every), add_special_tokens=False) == every
    assert tok.encode("é中🙂", add_special_tokens=False) == []  # outside ASCII: nothing


def test_chatml_template_with_generation_prompt(saved: Path) -> None:
    tok = load_tokenizer(saved)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without + "<|im_start|>assistant\n" == text
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 2

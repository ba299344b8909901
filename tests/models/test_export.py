"""A model folder other tools read as training did.

* ``AutoTokenizer`` in a process that never imports rollstream reads kit folders (a tokenizer
  folder, Qwen2 and Llama model folders) as the kit: every character of the alphabet, the
  special tokens, chat renderings with and without tools, and the prompts of every example
  config encode to the ids training uses and decode back.
* ``rollstream export`` writes a folder whose HF ``generate`` (prompt tokenized by
  ``AutoTokenizer``, stopping where ``generation_config.json`` says) equals the embedded
  engine's greedy tokens on the training ids.
* The save-time check fails loudly on a broken tokenizer file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.agent.chat import ChatRenderer
from rollstream.cli import main as cli
from rollstream.config import load_config
from rollstream.config.redact import saved_config
from rollstream.config.schema import LocalEngineConfig, RunConfig, TinyModelConfig
from rollstream.data.mix import TaskMix
from rollstream.durable import checkpoint as durable
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.models.export import export_run
from rollstream.models.folder_check import (
    CONVERSATION,
    TOOLS,
    FolderCheckError,
    check_model,
    check_tokenizer,
    save_char_tokenizer,
)
from rollstream.models.tiny import build_tiny_model
from rollstream.models.tokenizer import ALPHABET, IM_END, build_char_tokenizer
from tests.durable.whole import ROLLOUT, save_trainer
from tests.engine.helpers import make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# what a user's process runs: transformers alone
READER = """
import json, sys
from transformers import AutoTokenizer
case = json.load(open(sys.argv[1]))
out = {}
for folder in case["folders"]:
    tok = AutoTokenizer.from_pretrained(folder)
    out[folder] = {
        "ids": [tok.encode(t, add_special_tokens=False) for t in case["texts"]],
        "decoded": [tok.decode(ids) for ids in case["ids"]],
        "chats": [tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False,
                                          add_generation_prompt=True) for c in case["chats"]],
        "special_ids": [tok.convert_tokens_to_ids(t) for t in case["specials"]],
    }
out["imported"] = sorted({m.split(".")[0] for m in sys.modules} & {"rollstream", "tests"})
json.dump(out, sys.stdout)
"""


def _example_chats(tok) -> list[dict]:
    """The prompts of every example config's tasks: (messages, tools, the ids training uses)."""
    chats = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        mix = TaskMix(load_config(path, []).tasks, tok)
        for task in mix.eval_tasks()[:8]:
            source = mix.source(task.source)
            messages = (source.opening(task) if hasattr(source, "opening")
                        else [{"role": "user", "content": task.prompt_text}])
            expected = list(task.prompt_ids)
            if not hasattr(source, "opening"):  # a plain prompt: its text is the prompt
                chats.append({"text": task.prompt_text, "ids": expected})
                continue
            chats.append({"messages": messages, "tools": None, "ids": expected})
    assert chats
    return chats


@pytest.fixture(scope="module")
def kit_folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("kit")
    save_char_tokenizer(root / "tokenizer")
    for arch in ("qwen2", "llama"):
        cfg = TinyModelConfig(arch=arch, hidden_size=16, num_layers=1, num_heads=2,
                              num_kv_heads=1, intermediate_size=32, max_position=32)
        build_tiny_model(cfg, build_char_tokenizer(), root / arch)
    return [root / "tokenizer", root / "qwen2", root / "llama"]


def test_autotokenizer_without_rollstream_reads_kit_folders_as_the_kit(
        kit_folders: list[Path], tmp_path: Path) -> None:
    kit = build_char_tokenizer()
    specials = list(kit.all_special_tokens)
    texts = [*ALPHABET, ALPHABET, *specials, "".join(specials), "T517#07= 517/07\n12+7*3=(33)?"]
    ids = [kit.encode(t, add_special_tokens=False) for t in texts]
    chats = [{"messages": list(CONVERSATION[:n]), "tools": tools}
             for n in (2, len(CONVERSATION)) for tools in (None, list(TOOLS))]
    chat_ids = [ChatRenderer(kit, tools=c["tools"]).prompt(c["messages"]) for c in chats]
    examples = _example_chats(kit)
    texts += [e["text"] for e in examples if "text" in e]
    ids += [e["ids"] for e in examples if "text" in e]
    chats += [{"messages": e["messages"], "tools": None} for e in examples if "messages" in e]
    chat_ids += [e["ids"] for e in examples if "messages" in e]
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"folders": [str(f) for f in kit_folders], "texts": texts,
                                "ids": ids, "chats": chats, "specials": specials}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", READER, str(case)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out.pop("imported") == []
    for folder in kit_folders:
        got = out[str(folder)]
        for text, want, have in zip(texts, ids, got["ids"], strict=True):
            assert have == want, (folder.name, text)
        assert got["decoded"] == texts, folder.name
        assert got["special_ids"] == kit.convert_tokens_to_ids(specials)
        for chat, want, rendered in zip(chats, chat_ids, got["chats"], strict=True):
            # the user's process renders and encodes; the ids must be those training used
            assert kit.encode(rendered, add_special_tokens=False) == want, (folder.name, chat)
            assert rendered == ChatRenderer(kit, tools=chat["tools"]).text(
                chat["messages"], add_generation_prompt=True)


def _kit_run(root: Path) -> Path:
    """A run directory whose final checkpoint and durable checkpoint 3 hold a tiny Qwen2 with
    peaked logits (an initialisation wider than HF's) and the kit tokenizer."""
    tok = build_char_tokenizer()
    model = make_tiny_model(root / "model", vocab_size=len(tok), hidden_size=32,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    tok.save_pretrained(str(model))
    run = root / "run"
    shutil.copytree(model, run / "checkpoint")
    durable.write(run, 3, {"config": saved_config(RunConfig()), "rollout": ROLLOUT},
                  save_model=lambda d: shutil.copytree(model, d), save_trainer=save_trainer,
                  keep=2)
    return run


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    return export_run(_kit_run(root), out=root / "out").folder


def _engine_greedy(folder: Path, prompt: list[int], stop: list[int], n: int) -> list[int]:
    engine = LocalEngine(folder, LocalEngineConfig(max_slots=1, max_seq_len=128))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=tuple(stop))
        return engine.submit(GenerateRequest(request_id="g", prompt_ids=prompt,
                                             params=params)).result().token_ids
    finally:
        engine.shutdown()


def test_hf_generate_on_the_export_equals_the_engine_on_training_ids(exported: Path) -> None:
    kit = build_char_tokenizer()
    tok = AutoTokenizer.from_pretrained(str(exported))  # as a user loads it
    model = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    stop = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert stop == [kit.eos_token_id, kit.convert_tokens_to_ids(IM_END)]
    prompts = [ChatRenderer(tok).text([{"role": "user", "content": "add 12\nadd 7"}],
                                      add_generation_prompt=True), "T517#07= 517/07 518/06\n"]
    for text in prompts:
        trained = kit.encode(text, add_special_tokens=False)
        inputs = tok(text, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == trained
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        by_hf = out[0, len(trained):].tolist()
        assert by_hf == _engine_greedy(exported, trained, stop, 24), text


def _perturbed(folder: Path, out: Path) -> Path:
    """``folder`` with noise on every weight: a model whose greedy tokens part from it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    gen = torch.Generator().manual_seed(0)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen)
                   if v.is_floating_point() and v.numel() > 1 else v
                   for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return out


def test_the_model_check_parts_where_hf_generate_parts_and_fails_there(
        exported: Path, tmp_path: Path, monkeypatch) -> None:
    """The check's HF side (one forward pass along the engine's tokens) finds the first
    position where ``generate`` parts from the engine, with ``generate``'s logits there; and
    the check fails naming it when the engine reads other weights than HF."""
    from rollstream.models import folder_check

    other = _perturbed(exported, tmp_path / "other")
    stop = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    prompts = [[5, 6, 7], build_char_tokenizer().encode("T517#07= 517/07 518/06\n")]
    theirs = folder_check._engine_greedy(other, prompts, 24, stop, 0)
    ours = folder_check._hf_greedy(exported, prompts, theirs, stop, 0)
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    parted = 0
    for prompt, engine, (tokens, logits) in zip(prompts, theirs, ours, strict=True):
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=len(engine),
                                 do_sample=False, eos_token_id=stop, pad_token_id=stop[0],
                                 output_logits=True, return_dict_in_generate=True)
        by_hf = gen.sequences[0, len(prompt):].tolist()
        pos = next(j for j, (a, b) in enumerate(zip(by_hf, engine)) if a != b)
        parted += 1
        assert tokens[:pos + 1] == by_hf[:pos + 1] and tokens[pos] != engine[pos]
        torch.testing.assert_close(logits[:pos + 1], torch.stack(
            [x[0] for x in gen.logits[:pos + 1]]), rtol=1e-4, atol=1e-4)
    assert parted == len(prompts)
    monkeypatch.setattr(folder_check, "_engine_greedy",  # an engine that reads other weights
                        lambda *_: theirs)
    with pytest.raises(FolderCheckError, match="at generated token .* not a tie"):
        check_model(exported, prompts)


def test_export_cli_takes_a_step_and_a_dtype(exported: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    run = exported.parent / "run"
    out = tmp_path / "bf16"
    assert cli(["export", str(run), "--step", "3", "--out", str(out), "--dtype", "bfloat16",
                "--threads", "1"]) == 0
    said = capsys.readouterr().out
    assert "checkpoints/step_000003/model" in said and "(bfloat16)" in said, said
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (exported / name).read_bytes()
    assert cli(["export", str(run), "--step", "4", "--out", str(tmp_path / "x")]) == 2
    assert "no durable checkpoint of step 4; it has: [3]" in capsys.readouterr().err
    assert cli(["export", str(run), "--out", str(out)]) == 2  # not an empty folder
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert cli(["export", str(run), "--out", str(tmp_path / "x"), "--dtype", "fp8"]) == 2
    assert "--dtype must be one of float32, bfloat16, float16, got 'fp8'" in \
        capsys.readouterr().err


def _broken_copy(folder: Path, dst: Path, how: str) -> Path:
    shutil.copytree(folder, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    if how == "swapped":  # two byte tokens trade ids
        vocab = spec["model"]["vocab"]
        vocab["Ġ"], vocab["Ċ"] = vocab["Ċ"], vocab["Ġ"]
    elif how == "characters":  # space and newline spelled as themselves, as earlier kits did
        vocab = spec["model"]["vocab"]
        vocab[" "], vocab["\n"] = vocab.pop("Ġ"), vocab.pop("Ċ")
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


@pytest.mark.parametrize("how", ["swapped", "characters", "template"])
def test_the_save_check_fails_on_a_broken_tokenizer_file(exported: Path, tmp_path: Path,
                                                         how: str) -> None:
    broken = _broken_copy(exported, tmp_path / "broken", how)
    if how == "template":
        (broken / "chat_template.jinja").write_text(
            (broken / "chat_template.jinja").read_text().replace("'\n'", "' '", 1))
    check_tokenizer(exported, build_char_tokenizer())  # the intact folder passes
    with pytest.raises(FolderCheckError, match="AutoTokenizer reads its tokenizer differently"):
        check_tokenizer(broken, build_char_tokenizer())
    assert check_model(exported, [[5, 6, 7]]) == []  # the model round trip has no tie here


def test_the_docs_transformers_example_runs_on_an_export(exported: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    body = docs.split("## Hugging Face transformers\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert '"exports/tick-demo"' in block
    exec(compile(block.replace('"exports/tick-demo"', repr(str(exported))), "export.md", "exec"),
         {})
    assert len(capsys.readouterr().out.splitlines()) >= 2  # the two generations


def _bpe_tokenizer():
    """A tokenizer that is not the kit's: byte-level BPE with merges and a chat template that
    shows tools, as a real model folder has."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    core = Tokenizer(models.BPE(unk_token=None))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["the quick brown fox jumps over the lazy dog",
                              "add 12\nadd 7\n#calc 12+7", '{"name": "calc"}'] * 20,
                             BpeTrainer(vocab_size=400, show_progress=False,
                                        special_tokens=["<|endoftext|>", "<|im_start|>", IM_END],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
                "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", IM_END],
                                   chat_template=template)


def test_a_non_kit_folder_exports_its_tokenizer_files_byte_for_byte(tmp_path: Path) -> None:
    tok = _bpe_tokenizer()
    run = tmp_path / "run"
    make_tiny_model(run / "checkpoint", vocab_size=len(tok), hidden_size=32,
                    num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    tok.save_pretrained(str(run / "checkpoint"))
    done = export_run(run, out=tmp_path / "out")  # checked: AutoTokenizer reads it as `tok`
    names = sorted(p.name for p in (run / "checkpoint").iterdir()
                   if p.name.startswith(("tokenizer", "chat_template")))
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (done.folder / name).read_bytes() == (run / "checkpoint" / name).read_bytes()
    stop = json.loads((done.folder / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids(IM_END) in stop and tok.eos_token_id in stop

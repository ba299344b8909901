"""Check a written model folder the way other tools will read it.

A model folder is only an export if ``AutoTokenizer`` / ``AutoModelForCausalLM`` (and so vLLM,
TRL, an evaluation harness) read it as training saw it. Two checks, both loud
(:class:`FolderCheckError`, naming the folder, the probe and the first difference):

* :func:`check_tokenizer` (cheap, at every save): ``AutoTokenizer`` on the folder encodes and
  decodes a fixed set of probes (every character of the kit's alphabet, other scripts, every
  special token, chat-template renderings with and without tools) exactly as the tokenizer the
  run trained with, renders the same chat template and has the same special ids.
* :func:`check_model` (on the final checkpoint and on ``rollstream export``): the greedy tokens
  of a few prompts from ``AutoModelForCausalLM`` (its argmax along the engine's tokens, one
  forward pass each: :func:`_hf_greedy`) equal those of the embedded engine on the same
  weights. Both run in float32 (a bfloat16 folder is upcast: the check is about
  the folder, not about two kernels' bfloat16 rounding). Where they part, the position must
  be a near tie (top-2 logit gap under :data:`TIE_GAP` in the HF logits); such ties are
  returned, anything else raises.

:func:`stop_token_ids` is what ``generation_config.json`` stops on: end-of-text and the chat
template's end-of-turn token (the one the agent loop stops a model turn on).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.models.tokenizer import ALPHABET, build_char_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TIE_GAP = 1e-4  # top-2 logit gap below which two greedy decoders may pick differently

# a conversation with every role an episode has; the tools are shown by templates that take them
CONVERSATION = (
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "add 12\nadd 7"},
    {"role": "assistant", "content": "#calc 12+7"},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "=19"},
    {"role": "user", "content": "end"},
)
TOOLS = ({"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}},)
OTHER_TEXT = ("T517#07= 517/07 518/06\n12+7*3=(33)?:.,", "  two  spaces\n\n\tand tabs\r\n",
              "naïve café, ünïcödé, 中文, 🙂 <tool_call>{\"a\": 'b'}</tool_call> ~`|\\")


class FolderCheckError(ValueError):
    """A written model folder that another tool would read differently from training."""


def probe_texts(tokenizer: Any) -> list[str]:
    """Texts whose encoding a faithful copy of ``tokenizer`` must reproduce."""
    specials = list(tokenizer.all_special_tokens)
    texts = [*ALPHABET, ALPHABET, *OTHER_TEXT, *specials, "".join(specials),
             " ".join(f"{s}x\n" for s in specials)]
    return texts + [r for r in chat_renderings(tokenizer) if isinstance(r, str)]


def probe_prompts(tokenizer: Any) -> list[list[int]]:
    """A few prompts for :func:`check_model` where a caller has no tasks at hand: the
    conversation's opening under the chat template, and plain text."""
    texts = [r for r in chat_renderings(tokenizer)[:1] if r] + list(OTHER_TEXT[:2])
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def chat_renderings(tokenizer: Any) -> list[str | None]:
    """:data:`CONVERSATION` under ``tokenizer``'s chat template, with and without tools and
    the generation prompt (None where the template refuses them; [] without a template)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    out: list[str | None] = []
    for tools in (None, list(TOOLS)):
        for upto, prompt in ((2, True), (len(CONVERSATION), False), (len(CONVERSATION), True)):
            try:
                out.append(tokenizer.apply_chat_template(
                    list(CONVERSATION[:upto]), tools=tools, tokenize=False,
                    add_generation_prompt=prompt))
            except Exception:  # noqa: BLE001 - a template may refuse a role; both must agree
                out.append(None)
    return out


def check_tokenizer(folder: Path, reference: Any) -> None:
    """Raise :class:`FolderCheckError` unless ``AutoTokenizer`` reads ``folder``'s tokenizer
    as ``reference`` (the tokenizer training used) encodes and decodes (module docstring)."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - any load failure is this check's finding
        raise FolderCheckError(f"model folder {folder}: AutoTokenizer cannot load its "
                               f"tokenizer ({type(e).__name__}: {e})") from e
    problems = _tokenizer_differences(loaded, reference)
    if problems:
        raise FolderCheckError(
            f"model folder {folder}: AutoTokenizer reads its tokenizer differently from the "
            f"tokenizer training used ({len(problems)} difference(s); other tools would see "
            "other tokens):\n  " + "\n  ".join(problems[:5]))


def _tokenizer_differences(loaded: Any, reference: Any) -> list[str]:
    problems = [f"{name}: {got!r}, training used {want!r}" for name, got, want in (
        ("vocabulary size", len(loaded), len(reference)),
        ("eos_token_id", loaded.eos_token_id, reference.eos_token_id),
        ("pad_token_id", loaded.pad_token_id, reference.pad_token_id),
        ("bos_token_id", loaded.bos_token_id, reference.bos_token_id),
        ("special tokens", sorted(zip(loaded.all_special_tokens, loaded.all_special_ids)),
         sorted(zip(reference.all_special_tokens, reference.all_special_ids))),
        ("chat template", getattr(loaded, "chat_template", None),
         getattr(reference, "chat_template", None)),
        ("chat renderings", chat_renderings(loaded), chat_renderings(reference)),
    ) if got != want]
    for text in probe_texts(reference):
        plain = reference.encode(text, add_special_tokens=False)
        for how, got, want in (
                ("", loaded.encode(text, add_special_tokens=False), plain),
                (" with special tokens", loaded(text)["input_ids"], reference(text)["input_ids"])):
            if got != want:
                problems.append(f"encoding {text[:60]!r}{how}: {_first_difference(got, want)}")
        for skip in (False, True):
            got_text = loaded.decode(plain, skip_special_tokens=skip)
            if got_text != reference.decode(plain, skip_special_tokens=skip):
                problems.append(f"decoding {text[:60]!r} (skip_special_tokens={skip}): "
                                f"{got_text[:60]!r}")
    return problems


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"{len(got)} ids, training used {len(want)}; first difference at position {i}: "
            f"{list(got[i:i + 4])} instead of {list(want[i:i + 4])}")


def stop_token_ids(tokenizer: Any) -> list[int]:
    """End-of-text and, with a chat template, its end-of-turn token (first, as they are)."""
    from rollstream.agent.chat import ChatRenderer, TemplateError

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if getattr(tokenizer, "chat_template", None) is not None:
        try:
            turn = ChatRenderer(tokenizer).stop_token_ids([CONVERSATION[1]])
        except TemplateError:  # a template whose turns end without a special token
            turn = []
        ids += [t for t in turn if t not in ids]
    return ids


def write_stop_tokens(folder: Path, tokenizer: Any) -> None:
    """Make ``folder``'s generation_config.json stop at :func:`stop_token_ids` as well as at
    the ids it already names (a folder without one gets one)."""
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    have = gen.get("eos_token_id")
    have = [] if have is None else [have] if isinstance(have, int) else list(have)
    want = have + [t for t in stop_token_ids(tokenizer) if t not in have]
    if want != have:
        gen["eos_token_id"] = want
        path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


@dataclass(slots=True, kw_only=True, frozen=True)
class Tie:
    """Where HF ``generate`` and the engine parted on a near tie (accepted)."""

    prompt_index: int
    position: int  # index into the generated tokens
    gap: float  # top-2 logit gap of the HF logits there

    def __str__(self) -> str:
        return (f"prompt {self.prompt_index}: greedy decoders parted at generated token "
                f"{self.position} on a near tie (top-2 logit gap {self.gap:.2e} < {TIE_GAP})")


def check_model(folder: Path, prompts: Sequence[Sequence[int]], *,
                max_new_tokens: int = 24, threads: int = 0) -> list[Tie]:
    """Greedy tokens of ``prompts`` from ``AutoModelForCausalLM`` on ``folder`` against the
    embedded engine on the same folder (module docstring); returns the accepted ties.
    ``threads``: torch intra-op threads of both on a CPU (0 = as they are; a tiny model on a
    shared machine is many times faster on 1 than on several)."""
    from transformers import GenerationConfig

    if not prompts:
        raise ValueError("check_model needs at least one prompt")
    stop = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    stop = [] if stop is None else [stop] if isinstance(stop, int) else list(stop)
    engine_out = _engine_greedy(folder, prompts, max_new_tokens, stop, threads)
    ties = []
    for i, (prompt, theirs, (ours, logits)) in enumerate(zip(
            prompts, engine_out, _hf_greedy(folder, prompts, engine_out, stop, threads),
            strict=True)):
        if ours == theirs:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if pos is None:
            raise FolderCheckError(
                f"model folder {folder}: prompt {i}: HF generate gave {len(ours)} tokens, the "
                f"engine {len(theirs)} (HF: {ours}, engine: {theirs})")
        top2 = logits[pos].topk(2).values
        gap = float(top2[0] - top2[1])
        if gap >= TIE_GAP:
            raise FolderCheckError(
                f"model folder {folder}: prompt {i}: HF generate and the embedded engine part "
                f"at generated token {pos} (HF {ours[pos]}, engine {theirs[pos]}) where HF's "
                f"top-2 logit gap is {gap:.3g}, not a tie: AutoModelForCausalLM reads these "
                f"weights differently (HF: {ours}, engine: {theirs})")
        ties.append(Tie(prompt_index=i, position=pos, gap=gap))
    return ties


def _hf_greedy(folder: Path, prompts: Sequence[Sequence[int]], lengths: Sequence[list[int]],
               stop: Sequence[int], threads: int) -> list[tuple[list[int], Any]]:
    """``AutoModelForCausalLM``'s greedy token at each position of the engine's tokens
    (``lengths``: the engine's tokens per prompt; at least one) and its logits [T, vocab]
    (float32, on the CPU), on the engine's default device.

    One forward pass over the prompt and the engine's tokens per prompt, not ``generate``'s
    token by token: up to the first token where the two decoders part, greedy decoding's
    context is the engine's, so the argmax at each position is the token ``generate`` would
    pick, and the first position where it differs from the engine's is where ``generate``
    would part, with the same logits (within float rounding, which :data:`TIE_GAP` covers).
    Past that position the tokens are not ``generate``'s, and nothing reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.engine.local.device import resolve_device

    device = resolve_device("auto")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = model.to(device).eval()
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        out = []
        for prompt, theirs in zip(prompts, lengths, strict=True):
            ids = [*prompt, *theirs[:-1]]  # the last engine token predicts nothing read
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=device)).logits[0]
            logits = logits[len(prompt) - 1:].float().cpu()  # one row per engine token
            out.append((logits.argmax(-1).tolist(), logits))
        return out
    finally:
        torch.set_num_threads(before)


def _engine_greedy(folder: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop: Sequence[int], threads: int) -> list[list[int]]:
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import FinishReason, GenerateRequest, SamplingParams

    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = LocalEngine(folder, LocalEngineConfig(
        max_slots=len(prompts), max_seq_len=max(8, longest), dtype="float32",
        max_prefill_tokens=max(2048, longest), threads=threads))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                stop_token_ids=tuple(stop))
        futures = [engine.submit(GenerateRequest(request_id=uuid.uuid4().hex,
                                                 prompt_ids=list(p), params=params))
                   for p in prompts]
        outs = [f.result() for f in futures]
    finally:
        engine.shutdown()
    for out in outs:
        if out.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            raise FolderCheckError(f"model folder {folder}: the embedded engine could not "
                                   f"generate from it: {out.finish_reason.value} {out.error}")
    return [list(o.token_ids) for o in outs]


def save_char_tokenizer(out_dir: Path) -> PreTrainedTokenizerBase:
    """Build the kit tokenizer, save it into ``out_dir`` (created if needed) and check that
    ``AutoTokenizer`` reads it back as built."""
    tokenizer = build_char_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    check_tokenizer(out_dir, tokenizer)
    return tokenizer

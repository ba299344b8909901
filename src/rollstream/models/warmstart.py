"""Turn ``model:`` config into a Hugging Face folder: a given one, or a warm-started tiny model.

``prepare_model`` either validates ``model.path`` or builds the kit tokenizer and a tiny model,
trains it for ``warm_start.steps`` supervised steps on noisy demonstrations of the run's
training tasks, measures it, and caches the folder under ``{cache_dir}/{hash}/``. The hash
covers the tiny, warm-start and tasks sections and ``WARMSTART_VERSION``, so a second call
with the same config returns at once. The folder is written under a temporary name and
renamed into place, so a crash never leaves a half-written cache entry behind.

Each training sequence is ``prompt_ids + response_ids`` with the response being the
demonstration's tokens followed by the eos id (the end-of-turn token of the chat template for
an episode's first answer, a dataset row's of an agent source, where the agent loop stops a
turn; a generated agent source demonstrates whole conversations); the loss covers response
tokens only.
Demonstrations are drawn from the training split of the mix under a shifted seed (so RL does
not replay the warm-start stream); the held-out split is never seen. ``warmstart.json``
records sampled (temperature 1) and greedy accuracy on the eval tasks and the wall time;
accuracy is each source's own registered reward (``reward.name: auto``), called as a run
calls it: on a :class:`~rollstream.reward.registry.Response` decoded without special tokens,
``finish_reason`` "stop" when the generated ids ended in eos, else "length".

Simplifications: single process, fp32, HF ``generate`` for measurement only (the engines
live in ``rollstream.engine``); torch threads are whatever the caller set; rewards are called
in this process (``Reward.score``), without the grader pool's worker processes and timeout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rollstream.config.model import MOE_FIELDS
from rollstream.config.schema import ModelConfig, RewardConfig, TasksConfig, WarmStartConfig
from rollstream.data.mix import TaskMix, demonstration_config
from rollstream.data.sources import source_rewards
from rollstream.models.folder import validate_model_folder
from rollstream.models.tiny import init_tiny_model, num_parameters, save_model_folder
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.reward import Response, Reward, build_resolver, decode_response
from rollstream.trajectory import SINGLE_TURN, Task

log = logging.getLogger(__name__)

WARMSTART_VERSION = "3"  # bump when a change here alters the model a config produces
_DEMO_SEED_OFFSET = 1_000_003
_MICRO_BATCH_TOKENS = 2048  # padded tokens per forward pass
_WARMUP_STEPS = 10
_MIN_LR_FRACTION = 0.1

ScoreFn = Callable[[Task, Response], float]


def prepare_model(model_cfg: ModelConfig, tasks_cfg: TasksConfig,
                  resolve: Callable[[Task], Reward] | None = None) -> Path:
    """The HF folder the run loads: ``model.path`` if set, else the cached warm-started kit.
    ``resolve``: the run's rewards, which score the accuracy a new warm start reports (None:
    the sources' named rewards)."""
    if model_cfg.path is not None:
        return validate_model_folder(Path(model_cfg.path))
    folder = Path(model_cfg.cache_dir) / cache_key(model_cfg, tasks_cfg)
    if (folder / "warmstart.json").is_file():
        return folder.resolve()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _build(model_cfg, tasks_cfg, tmp, resolve)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (folder / "warmstart.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder.resolve()


def cache_key(model_cfg: ModelConfig, tasks_cfg: TasksConfig) -> str:
    """Content hash of everything that determines the warm-started model."""
    payload = {
        "version": WARMSTART_VERSION,
        # a dense model's hash leaves out the settings only qwen2_moe reads: its cache
        # entries from before they existed stay valid
        "tiny": model_cfg.tiny.model_dump(
            mode="json", exclude=None if model_cfg.tiny.arch == "qwen2_moe" else set(MOE_FIELDS)),
        "warm_start": model_cfg.warm_start.model_dump(mode="json"),
        # num_eval only sizes the measurement in warmstart.json, not the model; a source's
        # harness runs its episodes, it does not change their demonstrations; nor do the
        # settings the demonstrations are drawn without (data.mix.demonstration_config)
        "tasks": tasks_cfg.model_dump(mode="json", exclude={
            "num_eval": True, "mix": True, "pass_rate": True,
            "sources": {"__all__": {"harness", "max_oversample", "max_in_flight",
                                    "max_in_flight_per_task"}}}),
    }
    # except that a row's answer ends a turn when a harness runs it (warm_start): keyed only
    # then, so that every other config keeps its cache entry
    answers_end_turns = [i for i, src in enumerate(tasks_cfg.sources)
                         if src.episodic and src.kind != "tally"]
    if answers_end_turns:
        payload["answers_end_turns"] = answers_end_turns
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _build(model_cfg: ModelConfig, tasks_cfg: TasksConfig, out_dir: Path,
           resolve: Callable[[Task], Reward] | None) -> None:
    if resolve is None:
        resolve = build_resolver(RewardConfig(), source_rewards(tasks_cfg))

    def score(task: Task, response: Response) -> float:
        try:
            return resolve(task).score(task, response)
        except Exception:  # noqa: BLE001 - as in evaluation, a failed grade scores 0
            return 0.0

    tokenizer = build_char_tokenizer()
    model = init_tiny_model(model_cfg.tiny, tokenizer)
    eval_mix = TaskMix(tasks_cfg, tokenizer)
    t0 = time.perf_counter()
    train_stats = warm_start(
        model, tasks_cfg, model_cfg.warm_start, tokenizer, max_position=model_cfg.tiny.max_position
    )
    train_s = time.perf_counter() - t0
    # agent episodes are measured by the run's own evaluation (the agent loop), not here
    eval_tasks = [t for t in eval_mix.eval_tasks() if t.harness == SINGLE_TURN]
    t1 = time.perf_counter()
    sampled = _accuracy_by_source(model, tokenizer, eval_tasks, 1.0, score)
    greedy = _accuracy_by_source(model, tokenizer, eval_tasks, 0.0, score)
    eval_s = time.perf_counter() - t1
    save_model_folder(model, tokenizer, out_dir)
    report = {
        "version": WARMSTART_VERSION,
        "num_parameters": num_parameters(model),
        "steps": model_cfg.warm_start.steps,
        **train_stats,
        "num_eval_tasks": len(eval_tasks),
        "sampled_accuracy": _mean([x for xs in sampled.values() for x in xs]),
        "greedy_accuracy": _mean([x for xs in greedy.values() for x in xs]),
        "sampled_accuracy_by_source": {k: _mean(v) for k, v in sampled.items()},
        "greedy_accuracy_by_source": {k: _mean(v) for k, v in greedy.items()},
        "train_wall_s": round(train_s, 2),
        "eval_wall_s": round(eval_s, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    (out_dir / "warmstart.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("warm start cached in %s: %s", out_dir, report)


def warm_start(
    model: PreTrainedModel,
    tasks_cfg: TasksConfig,
    cfg: WarmStartConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_position: int,
) -> dict[str, float]:
    """Supervised steps on noisy demonstrations (response tokens only); returns train stats."""
    demo_cfg = demonstration_config(tasks_cfg)  # nothing reports back: drawn by weight
    mix = TaskMix(demo_cfg.model_copy(update={"seed": tasks_cfg.seed + _DEMO_SEED_OFFSET}),
                  tokenizer)
    rng = random.Random(f"warmstart/{tasks_cfg.seed}")
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.steps))
    model.train()
    num_tokens, last_loss = 0, float("nan")
    for step in range(cfg.steps):
        batch: list[tuple[list[int], list[bool]]] = []  # (token ids, which are targets)
        step_tokens = 0
        while step_tokens < cfg.tokens_per_step:
            task = mix.next_task()
            assert task is not None, "a mix without in-flight caps always has a task"
            source = mix.source(task.source)
            demo = source.demonstration(task, rng, cfg.noise)
            if isinstance(demo, str):
                end = eos if task.harness == SINGLE_TURN else turn_end(tokenizer)
                response = [*tokenizer.encode(demo, add_special_tokens=False), end]
                ids = [*task.prompt_ids, *response]
                targets = [False] * len(task.prompt_ids) + [True] * len(response)
            else:  # an agent episode: the model's turns are the targets
                ids, targets = source.renderer.episode(source.opening(task), demo)
            if len(ids) > max_position:
                raise ValueError(
                    f"a {task.source!r} demonstration needs {len(ids)} tokens but "
                    f"model.tiny.max_position is {max_position}: raise it or lower max_items"
                )
            batch.append((ids, targets))
            step_tokens += len(ids)
        last_loss = _train_step(model, opt, batch, pad_id=tokenizer.pad_token_id)
        sched.step()
        num_tokens += step_tokens
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            log.info("warm start step %d/%d loss %.4f", step + 1, cfg.steps, last_loss)
    model.eval()
    return {"num_train_tokens": num_tokens, "final_loss": round(last_loss, 4)}


def turn_end(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that ends a model turn under the tokenizer's chat template: what a dataset
    episode's first answer (its row's answer) is demonstrated with, since the agent loop stops
    a turn there and not at eos."""
    from rollstream.agent.chat import ChatRenderer

    return ChatRenderer(tokenizer).stop_token_ids([{"role": "user", "content": "?"}])[0]


def _lr_factor(step: int, total: int) -> float:
    """Linear warmup, then cosine decay to _MIN_LR_FRACTION."""
    if step < _WARMUP_STEPS:
        return (step + 1) / _WARMUP_STEPS
    progress = (step - _WARMUP_STEPS) / max(1, total - _WARMUP_STEPS)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return _MIN_LR_FRACTION + (1 - _MIN_LR_FRACTION) * cos


def _train_step(
    model: PreTrainedModel,
    opt: torch.optim.Optimizer,
    batch: list[tuple[list[int], list[bool]]],
    *,
    pad_id: int,
) -> float:
    """One optimizer step over ``batch``, micro-batched by length; mean loss per target token."""
    batch = sorted(batch, key=lambda b: len(b[0]))
    num_targets = sum(sum(targets) for _, targets in batch)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for micro in _micro_batches(batch):
        input_ids, labels = collate(micro, pad_id=pad_id)
        # Right padding under a causal mask: real tokens never attend to pads, pads carry no loss.
        logits = model(input_ids=input_ids).logits[:, :-1]
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
            )
            / num_targets
        )
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total


def collate(
    batch: Sequence[tuple[list[int], list[bool]]], *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [B, T] and ``labels`` [B, T]: -100 where a token is not a
    target (the prompt, an environment's tokens, padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (ids, targets) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        keep = torch.tensor(targets, dtype=torch.bool)
        labels[row, : len(ids)] = torch.where(keep, input_ids[row, : len(ids)], -100)
    return input_ids, labels


Demo = tuple[list[int], list[bool]]


def _micro_batches(batch: list[Demo]) -> list[list[Demo]]:
    """Split a length-sorted batch so each padded micro-batch holds about _MICRO_BATCH_TOKENS."""
    out: list[list[Demo]] = [[]]
    for item in batch:
        if out[-1] and (len(out[-1]) + 1) * len(item[0]) > _MICRO_BATCH_TOKENS:
            out.append([])
        out[-1].append(item)
    return out


def evaluate_accuracy(
    model_dir: Path | str,
    tasks: Sequence[Task],
    temperature: float,
    score: ScoreFn,
    *,
    max_new_tokens: int | None = None,
    seed: int = 0,
) -> float:
    """Mean ``score`` of one HF-``generate`` response per task (0 temperature = greedy); the
    response is cut after its first eos and graded as a run grades it (module docstring).

    ``max_new_tokens`` defaults to the longest reference plus its eos and a small margin: an
    exact-match answer never needs more.
    """
    if not tasks:
        raise ValueError("evaluate_accuracy needs at least one task")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    per_source = _accuracy_by_source(
        model, tokenizer, tasks, temperature, score, max_new_tokens=max_new_tokens, seed=seed
    )
    scores = [x for xs in per_source.values() for x in xs]
    return sum(scores) / len(scores)


@torch.no_grad()
def _accuracy_by_source(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    temperature: float,
    score: ScoreFn,
    *,
    max_new_tokens: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
) -> dict[str, list[float]]:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens is None:
        longest = max(
            (len(tokenizer.encode(t.reference, add_special_tokens=False)) for t in tasks), default=0
        )
        max_new_tokens = longest + 8
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    scores: dict[str, list[float]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lo in range(0, len(tasks), batch_size):
            chunk = tasks[lo : lo + batch_size]
            width = max(len(t.prompt_ids) for t in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, t in enumerate(chunk):  # left padding: every response starts at `width`
                input_ids[row, width - len(t.prompt_ids) :] = torch.tensor(t.prompt_ids)
                mask[row, width - len(t.prompt_ids) :] = 1
            room = model.config.max_position_embeddings - width
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(1, min(max_new_tokens, room)),
                eos_token_id=eos,
                pad_token_id=pad,
                **sampling,
            )
            for row, t in enumerate(chunk):
                ids = out[row, width:].tolist()
                stopped = eos in ids
                if stopped:
                    ids = ids[: ids.index(eos) + 1]
                response = decode_response(
                    tokenizer, ids, finish_reason="stop" if stopped else "length"
                )
                scores.setdefault(t.source, []).append(score(t, response))
    return scores


def _mean(xs: Sequence[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None

"""An optional GPU check: the embedded engine and the trainer on one CUDA device at
Qwen2.5-0.5B's shape, with random weights and random token ids, sized for under 5 minutes on
one H100 (an estimate until it has run on one; ``--budget-s`` bounds it whatever the speed).

    PYTHONPATH=src python -m rollstream.bench.gpu_check --out DIR            # on a GPU
    PYTHONPATH=src python -m rollstream.bench.gpu_check --out DIR --device cpu --tiny

Nothing is downloaded: the model folder (config.json written here with Qwen2.5-0.5B's shape:
hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings,
rope theta 1e6; random weights in safetensors) and the prompts (random token ids) are made
here. ``--tiny`` is a small shape and workload, for a smoke run on CPU in seconds.

Parts, in order, each writing ``DIR/<part>.json`` when it ends (``status``: ``ok``, or
``skipped`` with the ``reason``, or ``error`` with it; the others still run):

* ``env``: the device, torch, Python, and which of the imports below are missing.
* ``model``: the model folder written (in a temporary folder, not ``DIR``).
* ``engine_vs_hf``: a batch through the embedded engine, generated tokens/s, against HF
  ``model.generate`` on the same prompts and lengths (``engine_vs_hf_tok_s``).
* ``trainer``: trainer steps on groups of 8 sharing a prompt, trained tokens/s, flat and with
  shared-prefix training (``shared_prefix_vs_flat_trainer_step_s``).
* ``prefix``: groups of 8 sharing a long prompt through two engines, the prefix cache on and
  off (``prefix_cache_vs_none_gen_tok_s``, the hit share).
* ``rollout``: partial rollout against drain across weight updates
  (``partial_vs_drain_tok_s``; :mod:`rollstream.bench.gpu_rollout`).
* ``broadcast``: one round of the weight broadcast's buckets (``sync/broadcast.py``) from one
  rank to another through NCCL, packed and unpacked in GPU memory, checked bit for bit
  against the model's weights (``broadcast_exact``); it needs two GPUs (NCCL takes one per
  rank: skipped on one, saying so); on CPU the same round through gloo.
* ``gpu_check.json`` at the end: every part's status and key numbers, the device, the wall time.

Needs torch with CUDA (the machine's own). The engine parts need numpy, pydantic, pyyaml and
safetensors; HF ``generate`` and the trainer need transformers too. A part whose imports are
missing is skipped, naming them. Each part starts only while the ``--budget-s`` (default 270)
lasts, and its repeats stop when it is spent. A benchmark measures; it does not assert.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENGINE_NEEDS = ("torch", "numpy", "pydantic", "yaml", "safetensors")
TRAINER_NEEDS = (*ENGINE_NEEDS, "transformers")
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
              "tie_word_embeddings": True, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
TINY = {**QWEN25_05B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}


@dataclass(slots=True, kw_only=True, frozen=True)
class Sizes:
    batch: int  # engine_vs_hf: requests, each prompt + new tokens
    prompt: int
    new_tokens: int
    group_size: int  # trainer and prefix: samples sharing a prompt
    train_groups: int
    train_prompt: int
    train_answer: int
    prefix_groups: int
    prefix_prompt: tuple[int, int]  # uniform draws
    prefix_answer: tuple[int, int]
    prefix_rows: int
    rollout_requests: int
    rollout_rows: int
    rollout_prompt: int
    rollout_median: int
    rollout_cap: int
    updates: int
    repeats: int


FULL = Sizes(batch=64, prompt=128, new_tokens=128, group_size=8, train_groups=4,
             train_prompt=512, train_answer=128, prefix_groups=8, prefix_prompt=(256, 1024),
             prefix_answer=(16, 128), prefix_rows=32, rollout_requests=256, rollout_rows=64,
             rollout_prompt=128, rollout_median=64, rollout_cap=512, updates=4, repeats=2)
SMALL = Sizes(batch=4, prompt=16, new_tokens=8, group_size=4, train_groups=2, train_prompt=32,
              train_answer=8, prefix_groups=2, prefix_prompt=(32, 48), prefix_answer=(4, 8),
              prefix_rows=8, rollout_requests=12, rollout_rows=4, rollout_prompt=8,
              rollout_median=6, rollout_cap=16, updates=2, repeats=1)


@dataclass(slots=True, kw_only=True)
class Check:
    out: Path
    device: str
    dtype: str  # the engine's and the trainer's (bfloat16 on a GPU, float32 on CPU)
    sizes: Sizes
    shape: dict[str, Any]
    deadline: float  # time.monotonic()
    folder: Path | None = None


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def run_part(check: Check, name: str, needs: tuple[str, ...],
             fn: Callable[[Check], dict[str, Any]], blocked: str | None = None) -> dict[str, Any]:
    """Run one part unless ``blocked`` (why not), an import is missing or the budget is
    spent; write its JSON."""
    t0 = time.perf_counter()
    lacking = missing(needs)
    if blocked is not None or lacking:
        result: dict[str, Any] = {"status": "skipped",
                                  "reason": blocked or f"missing imports: {', '.join(lacking)}"}
    elif time.monotonic() > check.deadline:
        result = {"status": "skipped", "reason": "the time budget (--budget-s) was spent"}
    else:
        try:
            result = {"status": "ok", **fn(check)}
        except Exception as e:  # noqa: BLE001 - a part's failure is its result; the rest run
            result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        finally:
            _free(check.device)
    result["part_s"] = time.perf_counter() - t0
    (check.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    keys = {k: v for k, v in result.items() if k.endswith(("_tok_s", "_step_s", "reason",
                                                           "error", "status"))}
    print(f"{name}: {json.dumps(keys)}", flush=True)  # the bench's table: one line a part
    return result


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def env_part(check: Check) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"device": check.device, "device_name": torch.cuda.get_device_name(0) if cuda
            else platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version,
            "missing": missing(TRAINER_NEEDS), "dtype": check.dtype, "shape": check.shape,
            "sizes": asdict(check.sizes)}


def write_model(folder: Path, shape: dict[str, Any], dtype: str, device: str = "cpu",
                seed: int = 0) -> Path:
    """A Qwen2 folder of ``shape`` with random weights (N(0, 0.02), norms 1): config.json and
    model.safetensors, the names Hugging Face gives them. The draws run on ``device`` (494M
    of them at the full shape: ~20 s on a loaded 2-vCPU machine)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head, shape["num_key_value_heads"] * head
    gen, as_dtype = torch.Generator(device=device).manual_seed(seed), getattr(torch, dtype)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(as_dtype).cpu()

    tensors = {"model.embed_tokens.weight": w(vocab, h),
               "model.norm.weight": torch.ones(h, dtype=as_dtype)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(h, dtype=as_dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=as_dtype),
                    p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.q_proj.bias": w(q),
                    p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.k_proj.bias": w(kv),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.v_proj.bias": w(kv),
                    p + "self_attn.o_proj.weight": w(h, q), p + "mlp.gate_proj.weight": w(inter, h),
                    p + "mlp.up_proj.weight": w(inter, h), p + "mlp.down_proj.weight": w(h, inter)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "use_sliding_window": False, "attention_dropout": 0.0, "torch_dtype": dtype,
              "initializer_range": 0.02, **shape}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _engine(check: Check, rows: int, max_seq_len: int, **overrides: Any) -> Any:
    from rollstream.config.schema import LocalEngineConfig
    from rollstream.engine.local import LocalEngine

    assert check.folder is not None
    return LocalEngine(check.folder, LocalEngineConfig(
        max_slots=rows, max_seq_len=max_seq_len, device=check.device, dtype=check.dtype,
        max_prefill_tokens=max(2048, max_seq_len), **overrides))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def _best_s(fn: Callable[[], float], repeats: int, deadline: float) -> list[float]:
    """Seconds of ``fn`` (after one warm-up call), ``repeats`` times or until ``deadline``."""
    fn()
    times = []
    for _ in range(repeats):
        times.append(fn())
        if time.monotonic() > deadline:
            break
    return times


def engine_vs_hf_part(check: Check) -> dict[str, Any]:

    from rollstream.bench.engine import _time_requests

    sz, vocab = check.sizes, check.shape["vocab_size"]
    rng = random.Random(1)
    prompts = [_ids(rng, sz.prompt, vocab) for _ in range(sz.batch)]
    lengths = [sz.new_tokens] * sz.batch
    engine = _engine(check, sz.batch, sz.prompt + sz.new_tokens)
    try:
        engine_s = _best_s(lambda: _time_requests(engine, prompts, lengths, "e"), sz.repeats,
                           check.deadline)
    finally:
        engine.shutdown()
    out: dict[str, Any] = {"batch": sz.batch, "prompt": sz.prompt, "new_tokens": sz.new_tokens,
                           "engine_s": engine_s,
                           "engine_tok_s": sz.batch * sz.new_tokens / min(engine_s)}
    if missing(("transformers",)):
        return {**out, "hf_skipped": "missing imports: transformers"}
    hf_s = _hf_seconds(check, prompts)
    hf_tok_s = sz.batch * sz.new_tokens / min(hf_s)
    return {**out, "hf_s": hf_s, "hf_tok_s": hf_tok_s,
            "engine_vs_hf_tok_s": out["engine_tok_s"] / hf_tok_s}


def _hf_seconds(check: Check, prompts: list[list[int]]) -> list[float]:
    """Seconds of HF ``generate`` on ``prompts`` (one batch, no padding: equal lengths),
    sampling at temperature 1 exactly ``new_tokens`` each."""
    import torch
    from transformers import AutoModelForCausalLM

    new = check.sizes.new_tokens
    hf = AutoModelForCausalLM.from_pretrained(check.folder, dtype=getattr(torch, check.dtype))
    hf = hf.to(check.device).eval()
    ids = torch.tensor(prompts, device=check.device)

    def generate() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            got = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                              max_new_tokens=new, min_new_tokens=new)
        _sync(check)
        assert got.shape[1] == ids.shape[1] + new, "HF generate stopped early"
        return time.perf_counter() - t0

    return _best_s(generate, check.sizes.repeats, check.deadline)


def _sync(check: Check) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously to the timer)."""
    if check.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()

def trainer_part(check: Check) -> dict[str, Any]:
    """Trainer steps (one update each) on one batch, flat and with shared-prefix training,
    one trainer at a time (each holds the model, its gradients and AdamW's state: freed when
    its measurement returns)."""
    from rollstream.bench.prefix_train import random_groups

    sz, vocab = check.sizes, check.shape["vocab_size"]
    rng = random.Random(2)
    prompts = [p for _ in range(sz.train_groups)
               for p in [_ids(rng, sz.train_prompt, vocab)] * sz.group_size]
    lengths = [sz.train_answer] * len(prompts)
    groups = random_groups(prompts, lengths, sz.group_size, vocab, seed=0)
    tokens = len(prompts) * (sz.train_prompt + sz.train_answer)
    step_s = {mode: _trainer_seconds(check, mode, groups) for mode in ("off", "auto")}
    flat, shared = min(step_s["off"]), min(step_s["auto"])
    return {"groups": sz.train_groups, "group_size": sz.group_size, "prompt": sz.train_prompt,
            "answer": sz.train_answer, "tokens_per_step": tokens,
            "step_s": {"flat": step_s["off"], "shared": step_s["auto"]},
            "trainer_tok_s": tokens / flat, "shared_prefix_trainer_tok_s": tokens / shared,
            "shared_prefix_vs_flat_trainer_step_s": flat / shared}


def _trainer_seconds(check: Check, shared_prefix: str, groups: list[Any]) -> list[float]:
    """Seconds per trainer step on ``groups`` with ``train.shared_prefix: shared_prefix``."""
    from rollstream.config.schema import TrainConfig
    from rollstream.staleness import StalenessPolicy
    from rollstream.train.trainer import Trainer

    trainer = Trainer(TrainConfig(shared_prefix=shared_prefix, updates_per_step=1,
                                  dtype=check.dtype), check.folder,
                      staleness=StalenessPolicy(max_staleness=0), device=check.device)
    steps = itertools.count()

    def step() -> float:
        t0 = time.perf_counter()
        trainer.step(groups, step=next(steps))
        _sync(check)
        return time.perf_counter() - t0

    return _best_s(step, check.sizes.repeats, check.deadline)


def prefix_part(check: Check) -> dict[str, Any]:
    """Groups sharing a prompt through two engines that differ only in the prefix cache
    (its default against 0), alternated; new prompts in each repeat."""
    from rollstream.bench.engine import _time_requests

    sz, vocab = check.sizes, check.shape["vocab_size"]
    max_seq_len = sz.prefix_prompt[1] + sz.prefix_answer[1]
    engines = {"cache": _engine(check, sz.prefix_rows, max_seq_len),
               "none": _engine(check, sz.prefix_rows, max_seq_len, prefix_cache_tokens=0)}

    def workload(seed: int) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(seed)
        prompts, lengths = [], []
        for _ in range(sz.prefix_groups):
            prompts += [_ids(rng, rng.randint(*sz.prefix_prompt), vocab)] * sz.group_size
            lengths += [rng.randint(*sz.prefix_answer) for _ in range(sz.group_size)]
        return prompts, lengths

    tok_s: dict[str, list[float]] = {"cache": [], "none": []}
    try:
        warm, warm_lengths = workload(-1)
        for name, e in engines.items():
            _time_requests(e, warm[:sz.group_size], warm_lengths[:sz.group_size], f"w{name}")
        before = engines["cache"].stats().work
        for rep in range(sz.repeats):
            if rep and time.monotonic() > check.deadline:
                break
            prompts, lengths = workload(rep)
            for name, rates in tok_s.items():
                rates.append(sum(lengths) / _time_requests(engines[name], prompts, lengths,
                                                           f"r{rep}{name}"))
        after = engines["cache"].stats().work
    finally:
        for e in engines.values():
            e.shutdown()
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    query = after["prefix_query_tokens"] - before["prefix_query_tokens"]
    return {"groups": sz.prefix_groups, "group_size": sz.group_size, "rows": sz.prefix_rows,
            "gen_tok_s": tok_s, "hit_share": hit / max(query, 1.0),
            "prefix_cache_vs_none_gen_tok_s": max(tok_s["cache"]) / max(tok_s["none"])}


def rollout_part(check: Check) -> dict[str, Any]:
    from safetensors.torch import load_file

    from rollstream.bench import gpu_rollout

    sz = check.sizes
    assert check.folder is not None
    work = gpu_rollout.workload(sz.rollout_requests, sz.rollout_prompt, sz.rollout_median,
                                sz.rollout_cap, check.shape["vocab_size"])
    tensors = load_file(str(check.folder / "model.safetensors"), device=check.device)
    engine = _engine(check, sz.rollout_rows, sz.rollout_prompt + sz.rollout_cap)
    try:
        return gpu_rollout.rollout_part(engine, tensors, work, rows=sz.rollout_rows,
                                        updates=sz.updates, repeats=sz.repeats,
                                        deadline=check.deadline)
    finally:
        engine.shutdown()


def broadcast_part(check: Check) -> dict[str, Any]:
    """One round of the broadcast transport's buckets between two ranks, each in a thread of
    this process: NCCL on two GPUs (it takes a device per rank, so one GPU cannot hold a
    round), gloo on CPU. The receiver's weights must equal the model's bit for bit."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rollstream.sync.broadcast import make_group, receive_buckets, send_buckets
    from rollstream.sync.buckets import plan_buckets

    if check.device != "cpu" and torch.cuda.device_count() < 2:
        return {"status": "skipped", "reason": "an NCCL round needs two GPUs (one per rank); "
                f"torch sees {torch.cuda.device_count()}"}
    assert check.folder is not None
    tensors = load_file(check.folder / "model.safetensors")
    backend = "gloo" if check.device == "cpu" else "nccl"
    devices = ("cpu", "cpu") if backend == "gloo" else ("cuda:0", "cuda:1")
    plan = plan_buckets(tensors, 64 << 20)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)

    def rank(r: int) -> dict[str, torch.Tensor] | None:
        if backend == "nccl":
            torch.cuda.set_device(devices[r])
        store = server if r == 0 else \
            dist.TCPStore("127.0.0.1", server.port, 2, False, timedelta(seconds=60))
        group = make_group(store, "gpu-check", r, 2, "127.0.0.1", 60.0, backend=backend)
        if r == 0:
            send_buckets(group, tensors, plan, devices[0])
            return None
        return receive_buckets(group, plan, devices[1])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        _, out = list(pool.map(rank, (0, 1)))
    seconds = time.perf_counter() - t0
    assert out is not None
    exact = all(torch.equal(out[k].cpu().view(torch.uint8), t.view(torch.uint8))
                for k, t in tensors.items())
    return {"backend": backend, "buckets": len(plan), "broadcast_s": seconds,
            "broadcast_exact": float(exact)}


def model_part(check: Check) -> dict[str, Any]:
    assert check.folder is not None  # where to write it: a temporary folder, not --out
    write_model(check.folder, check.shape, check.dtype, check.device)
    return {"bytes": (check.folder / "model.safetensors").stat().st_size}


PARTS: tuple[tuple[str, tuple[str, ...], Callable[[Check], dict[str, Any]]], ...] = (
    ("env", ("torch",), env_part),
    ("model", ("torch", "safetensors"), model_part),
    ("engine_vs_hf", ENGINE_NEEDS, engine_vs_hf_part),
    ("trainer", TRAINER_NEEDS, trainer_part),
    ("prefix", ENGINE_NEEDS, prefix_part),
    ("rollout", ENGINE_NEEDS, rollout_part),
    ("broadcast", ("torch", "safetensors"), broadcast_part),
)
KEYS = ("engine_tok_s", "hf_tok_s", "engine_vs_hf_tok_s", "trainer_tok_s",
        "shared_prefix_trainer_tok_s", "shared_prefix_vs_flat_trainer_step_s",
        "prefix_cache_vs_none_gen_tok_s", "hit_share", "partial_tok_s", "drain_tok_s",
        "partial_vs_drain_tok_s", "broadcast_s", "broadcast_exact", "device_name", "torch", "missing", "reason", "error",
        "hf_skipped")  # what the summary repeats of each part


def _no_device(device: str) -> str | None:
    """Why ``device`` cannot run the parts (None: it can, or torch is missing: said then)."""
    if device == "cpu" or missing(("torch",)):
        return None
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"CUDA is not available to torch {torch.__version__} (cuda {torch.version.cuda})"
    return None if device.startswith("cuda") else f"--device must be cuda or cpu, got {device!r}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every part (module docstring); the summary, also written to ``DIR/gpu_check.json``."""
    ap = argparse.ArgumentParser(prog="python -m rollstream.bench.gpu_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the parts' JSON")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and workload (smoke)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="no part starts, and no repeat, after this many seconds")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    check = Check(out=args.out, device=args.device,
                  dtype="float32" if args.device == "cpu" else "bfloat16",
                  sizes=SMALL if args.tiny else FULL, shape=TINY if args.tiny else QWEN25_05B,
                  deadline=t0 + args.budget_s)
    parts: dict[str, dict[str, Any]] = {}
    no_device = _no_device(args.device)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        check.folder = Path(tmp) / "model"
        for name, needs, fn in PARTS:
            model = parts.get("model", {"status": "ok"})
            blocked = None if model["status"] == "ok" else \
                f"no model folder: {model.get('reason') or model.get('error')}"
            parts[name] = run_part(check, name, needs, fn,
                                   blocked or (None if name == "env" else no_device))
    summary = {"tiny": args.tiny, "device": args.device, "wall_s": time.monotonic() - t0,
               "parts": {name: {"status": r["status"], "part_s": r["part_s"],
                                **{k: r[k] for k in KEYS if k in r}}
                         for name, r in parts.items()}}
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()

"""``bench models``: the model shapes users train. Its LoRA section: what a weight sync moves
and costs with an adapter against full weights, on the embedded engine.

For each model shape (the demo's: hidden 128, 4 layers; and hidden 512) and each adapter
target set (every linear layer; attention only), at rank 8: a kit model folder, the
adapter peft puts on it (B drawn at random, so that the merge is not a no-op; bytes and
time do not depend on values), and one idle embedded engine. ``lora_sync_bytes_vs_full``:
the adapter payload's bytes (``sync/protocol.py``'s ``adapter`` kind) / the full state
dict's, what the run's ``sync_bytes`` metric records; beside it ``bytes_vs_targeted``, the
adapter's bytes / those of the weights it adapts, whose expected value is
``2r(d_in + d_out) / (d_in d_out)`` averaged over the targeted weights.
``lora_sync_s_vs_full``: the median seconds of ``Engine.load_weights`` with the adapter
(checked, merged onto the engine's base copy, copied in) / with the full state dict, over
``NUM_SYNCS`` loads after a warm-up. Merged at load or a low-rank term in the forward pass:
``lowrank_step_s`` is what the term would add to one decode step of ``DECODE_ROWS`` rows (the
two small matmuls ``(x A^T) B^T`` of every adapted layer, one thread, the matmuls alone), and
``merge_breakeven_steps`` = ``adapter_sync_s / lowrank_step_s``: with more decode steps than
that per version, merging at load costs less. Then two short training runs of
examples/tick_lora.yaml (async k = 2, groups of 8, tick) on the demo shape's folder (random
weights, so every group is kept: ``rollout.filter_zero_variance=false``), ``RUN_SIZES``
steps, groups per step and new tokens, placed as ``bench modes`` places a run: ``lora`` (the
YAML's adapter, rank 8 on every linear layer) then ``full`` (``model.lora=null``), back to
back (:mod:`.short_runs`); ``lora_vs_full_samples_per_s`` = trained samples/s of ``lora`` ÷
``full``, each run's reading under ``lora_runs``. On vLLM (not with ``--quick``): the sync
(``lora_vllm``, on the demo shape's every-layer adapter) is :func:`bench_vllm_sync`'s, and the
same two runs with ``engine.kind=vllm`` give ``lora_vs_full_samples_per_s_vllm`` (each run's
reading under ``lora_runs_vllm``). The mixture-of-experts sections (``moe``, ``moe_runs``) are
:mod:`.models_moe`'s: routing replay against a bfloat16 engine, and the held-out reward of a
short run of the MoE example with replay and without. A benchmark measures; it
does not assert.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rollstream.run_files import VLLM_LOGS

NUM_SYNCS = 10
DECODE_ROWS = 64  # rows of one decode step for the low-rank term's cost
RANK = 8
VLLM_MAX_MODEL_LEN = 128  # the LoRA sync on vLLM (bench_vllm_sync)
SHAPES: dict[str, dict[str, int]] = {
    "demo": {"hidden_size": 128, "num_layers": 4, "intermediate_size": 384},
    "h512": {"hidden_size": 512, "num_layers": 4, "intermediate_size": 1536, "num_heads": 8,
             "num_kv_heads": 4},
}
TARGETS = {"all": None, "attention": ("q_proj", "k_proj", "v_proj", "o_proj")}
LORA_YAML = Path(__file__).resolve().parents[3] / "examples" / "tick_lora.yaml"
RUN_SIZES = (20, 8, 64)
"""The training runs' steps, groups per step and new tokens per sample."""


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


async def _load_s(engine: Any, tensors: dict, first: int) -> float:
    times = []
    for v in range(first, first + NUM_SYNCS + 1):
        t0 = time.perf_counter()
        await engine.load_weights(v, tensors)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is the warm-up


def _lowrank_step_s(adapter: dict) -> float:
    """Seconds the low-rank term adds to one decode step (module docstring), median of 20."""
    import torch

    pairs = [(adapter[n], adapter[n.replace(".lora_A.", ".lora_B.")]) for n in adapter
             if ".lora_A." in n]
    xs = [torch.randn(DECODE_ROWS, a.shape[1]) for a, _ in pairs]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's step thread runs (engine.local.threads: 1)
    try:
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            for x, (a, b) in zip(xs, pairs):
                (x @ a.t()) @ b.t()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])


def shape_tensors(folder: Path, targets: tuple[str, ...] | None) -> tuple[dict, dict]:
    """The folder's full state dict and a rank-``RANK`` adapter on ``targets`` (None: every
    linear layer) as weight sync sends them."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.config.model import LoraConfig
    from rollstream.train import lora

    cfg = LoraConfig(rank=RANK, alpha=2.0 * RANK, **({} if targets is None else
                                                      {"target_modules": targets}))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    full = {k: t.detach().clone() for k, t in model.state_dict().items()}
    wrapped = lora.wrap(model, cfg, folder)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(0))
    return full, {k: t.clone() for k, t in lora.sync_tensors(wrapped).items()}


def bench_shape(folder: Path, targets: tuple[str, ...] | None) -> dict[str, Any]:
    """One shape and target set: bytes and load seconds, adapter against full."""
    from rollstream.config.schema import EngineConfig
    from rollstream.engine.factory import build_engine

    full, adapter = shape_tensors(folder, targets)
    targeted = sum(full[name.rsplit(".lora_", 1)[0] + ".weight"].numel() * 4
                   for name in adapter if name.endswith(".lora_A.weight"))

    async def timed() -> tuple[float, float]:
        engine = build_engine(EngineConfig(local={"max_slots": 4, "max_seq_len": 128,
                                                  "threads": 1}), folder)
        try:
            full_s = await _load_s(engine, full, 1)
            adapter_s = await _load_s(engine, adapter, 100)
        finally:
            await engine.close()
        return full_s, adapter_s

    full_s, adapter_s = asyncio.run(timed())
    lowrank_s = _lowrank_step_s(adapter)
    return {"lowrank_step_s": lowrank_s, "merge_breakeven_steps": adapter_s / lowrank_s,
            "full_bytes": _nbytes(full), "adapter_bytes": _nbytes(adapter),
            "lora_sync_bytes_vs_full": _nbytes(adapter) / _nbytes(full),
            "bytes_vs_targeted": _nbytes(adapter) / targeted,
            "full_sync_s": full_s, "adapter_sync_s": adapter_s,
            "lora_sync_s_vs_full": adapter_s / full_s}


def lora_runs(folder: Path, run_root: Path, *, quick: bool,
              vllm: bool = False) -> dict[str, Any]:
    """A short LoRA run against a full fine-tune of the same shape (module docstring), on the
    embedded engine or (``vllm``) on a vLLM server the run launches."""
    from rollstream.bench.modes import bench_overrides
    from rollstream.bench.short_runs import run_back_to_back, samples_per_s_ratio

    steps, groups, new_tokens = (2, 2, 16) if quick else RUN_SIZES
    common = [*bench_overrides(folder, run_root), f"train.steps={steps}",
              f"train.groups_per_step={groups}", f"sampling.max_new_tokens={new_tokens}",
              "rollout.filter_zero_variance=false", "tasks.num_eval=2",
              "eval.samples_per_task=1", "model.lora.export_merged=false"]
    if vllm:
        common += ["engine.kind=vllm", f"engine.vllm.max_model_len={VLLM_MAX_MODEL_LEN}"]
    runs = run_back_to_back(LORA_YAML, common, {"lora": [], "full": ["model.lora=null"]},
                            bench="models")
    return {"runs": runs, "steps": steps, "groups_per_step": groups,
            "max_new_tokens": new_tokens,
            "lora_vs_full_samples_per_s": samples_per_s_ratio(runs, "lora", "full")}


def main(json_out: Path | None = None, quick: bool = False) -> dict:
    from rollstream.bench.models_moe import bench_moe, moe_runs
    from rollstream.bench.weightsync import build_model

    load_start = os.getloadavg()[0]
    shapes = {"demo": SHAPES["demo"]} if quick else SHAPES
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, overrides in shapes.items():
            folder = build_model(Path(tmp) / shape, **overrides)
            for target, modules in TARGETS.items():
                rows[f"{shape}/{target}"] = bench_shape(folder, modules)
            if shape == "demo":
                runs = lora_runs(folder, Path(tmp) / "runs", quick=quick)
                on_vllm = None if quick else bench_vllm_sync(
                    folder, *shape_tensors(folder, None), log_dir=Path(tmp) / VLLM_LOGS)
                runs_vllm = None if quick else lora_runs(folder, Path(tmp) / "runs-vllm",
                                                         quick=False, vllm=True)
        moe = bench_moe(build_model(Path(tmp) / "moe", arch="qwen2_moe", **SHAPES["demo"]),
                        quick=quick)
        # quick: its unwarmed model in this run's folder, not the cache of real runs
        moe_heldout = moe_runs(Path(tmp) / "runs-moe", Path(tmp) / "cache" if quick else None,
                               quick=quick)
    demo = rows["demo/all"]
    result = {"quick": quick, "rank": RANK, "num_syncs": NUM_SYNCS, "engine": "local",
              "lora": rows, "lora_sync_bytes_vs_full": demo["lora_sync_bytes_vs_full"],
              "lora_sync_s_vs_full": demo["lora_sync_s_vs_full"],
              "lora_runs": runs,
              "lora_vs_full_samples_per_s": runs["lora_vs_full_samples_per_s"],
              "lora_vllm": on_vllm,
              "lora_runs_vllm": runs_vllm,
              "lora_vs_full_samples_per_s_vllm": None if runs_vllm is None else
              runs_vllm["lora_vs_full_samples_per_s"],
              "moe": moe,
              "mismatch_replay_vs_none": moe["mismatch_replay_vs_none"],
              "mismatch_replay_vs_none_bound": moe["mismatch_replay_vs_none_bound"],
              "routing_agreement": moe["routing_agreement"],
              "moe_runs": moe_heldout,
              "loadavg_1m": {"start": load_start, "end": os.getloadavg()[0]}}
    _print_table(rows)
    lora, full = runs["runs"]["lora"], runs["runs"]["full"]
    print(f"training runs ({runs['steps']} steps of {runs['groups_per_step']} groups of 8, "
          f"demo shape, every linear layer at rank {RANK}): trained samples/s "
          f"{lora['trained_samples_per_s']:.1f} with LoRA, {full['trained_samples_per_s']:.1f} "
          f"full (ratio {runs['lora_vs_full_samples_per_s']:.2f}); sync bytes "
          f"{lora['sync_bytes'] / 1e6:.1f} MB vs {full['sync_bytes'] / 1e6:.1f} MB")
    if on_vllm is not None:
        print(f"vLLM, demo shape, every linear layer at rank {RANK}: adapter sync "
              f"{on_vllm['lora_sync_bytes_vs_full']:.3f} of the full bytes, "
              f"{on_vllm['adapter_sync_s'] * 1e3:.0f} ms vs "
              f"{on_vllm['full_sync_s'] * 1e3:.0f} ms (ratio "
              f"{on_vllm['lora_sync_s_vs_full']:.2f})")
    if runs_vllm is not None:
        lora_v, full_v = runs_vllm["runs"]["lora"], runs_vllm["runs"]["full"]
        print(f"training runs on vLLM (the same): trained samples/s "
              f"{lora_v['trained_samples_per_s']:.1f} with LoRA, "
              f"{full_v['trained_samples_per_s']:.1f} full (ratio "
              f"{runs_vllm['lora_vs_full_samples_per_s']:.2f})")
    print(f"MoE, bfloat16 engine vs float32 trainer: mismatch {moe['mismatch_none']:.4f} "
          f"without replay, {moe['mismatch_replay']:.4f} with (ratio "
          f"{moe['mismatch_replay_vs_none']:.3f}; bound {moe['mismatch_replay_vs_none_bound']:.3f}"
          f"); routing agreement {moe['routing_agreement']:.3f} over {moe['num_samples']} "
          f"samples; on the {moe['disagreeing_tokens']} tokens whose routing disagreed: "
          f"{moe['mismatch_disagreeing']:.4f} without replay, "
          f"{moe['mismatch_disagreeing_replay']:.4f} with (the "
          f"{moe['agreeing_tokens']} agreeing: {moe['mismatch_agreeing']:.4f})")
    for label in ("replay", "no_replay"):
        r = moe_heldout[label]
        print(f"MoE example, {moe_heldout['steps']} steps, {label.replace('_', ' ')}: held-out "
              f"reward {r['reward_initial']:.3f} -> {r['reward_final']:.3f} "
              f"(se {r['reward_final_se']:.3f}), routing agreement "
              f"{_fmt(r['routing_agreement_mean'])}, mismatch {_fmt(r['mismatch_mean'])}, "
              f"{r['train_wall_s']:.0f} s")
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _print_table(rows: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"LoRA (rank {RANK}) weight sync vs full, embedded engine")
    for col in ("shape/targets", "full MB", "adapter MB", "bytes vs full", "vs targeted",
                "full s", "adapter s", "s vs full", f"low-rank s/step ({DECODE_ROWS} rows)",
                "merge break-even (steps)"):
        table.add_column(col)
    for name, r in rows.items():
        table.add_row(name, f"{r['full_bytes'] / 1e6:.2f}", f"{r['adapter_bytes'] / 1e6:.3f}",
                      f"{r['lora_sync_bytes_vs_full']:.3f}", f"{r['bytes_vs_targeted']:.3f}",
                      f"{r['full_sync_s'] * 1e3:.2f} ms", f"{r['adapter_sync_s'] * 1e3:.2f} ms",
                      f"{r['lora_sync_s_vs_full']:.2f}", f"{r['lowrank_step_s'] * 1e3:.3f} ms",
                      f"{r['merge_breakeven_steps']:.1f}")
    Console(width=160).print(table)


def bench_vllm_sync(folder: Path, full: dict, adapter: dict, log_dir: Path) -> dict[str, Any]:
    """Load seconds and bytes on a LoRA vLLM engine serving ``folder``, at rank 8 on every
    linear layer (the adapter of :func:`bench_shape`): ``lora_sync_bytes_vs_full``, the
    adapter's bytes / the full state dict's (what the engine wrote for its server,
    ``SyncTiming.num_bytes``), and ``lora_sync_s_vs_full``, the median seconds of
    ``VllmEngine.load_weights`` with the adapter (PEFT folder written to shared memory, then
    loaded into the server's adapter slot in place) / with the full state dict (buckets
    written, ``reload_weights``, and, this engine serving LoRA, its slot reset to the zero
    adapter, which a full load on a LoRA engine does), over ``NUM_SYNCS`` loads after a
    warm-up, each inside the server's ``/pause`` ... ``/resume`` (docs/lora.md, "LoRA on
    vLLM"). Training runs on vLLM: :func:`lora_runs` with ``vllm=True``."""
    from rollstream.config.model import LoraConfig
    from rollstream.config.schema import EngineConfig, VllmEngineConfig
    from rollstream.engine.vllm import build_vllm_engine

    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=VLLM_MAX_MODEL_LEN))
    engine = build_vllm_engine(cfg, folder, log_dir=log_dir,
                               lora=LoraConfig(rank=RANK, alpha=2.0 * RANK))

    async def timed() -> tuple[float, float, int, int]:
        full_s = await _load_s(engine, full, 1)
        full_moved = engine.sync_timings[-1].num_bytes
        adapter_s = await _load_s(engine, adapter, 100)
        return full_s, adapter_s, full_moved, engine.sync_timings[-1].num_bytes

    try:
        full_s, adapter_s, full_moved, adapter_moved = asyncio.run(timed())
    finally:
        engine.shutdown()
    return {"full_bytes": full_moved, "adapter_bytes": adapter_moved,
            "adapter_payload_bytes": _nbytes(adapter),
            "lora_sync_bytes_vs_full": adapter_moved / full_moved,
            "full_sync_s": full_s, "adapter_sync_s": adapter_s,
            "lora_sync_s_vs_full": adapter_s / full_s}

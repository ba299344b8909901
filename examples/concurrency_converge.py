"""Adaptive concurrency converging on the embedded engine (docs/dispatch.md).

One engine, one random Qwen2-shaped model, a fifo dispatch queue kept full (2 x capacity
requests of 64 tokens outstanding): first the throughput at fixed slot counts 1, 2, 4, ...,
capacity (``--fixed-s`` each), then ``rollout.concurrency: adaptive`` for ``--adaptive-s``,
printing the limit and the throughput every 2 s and every window the controller measured.

    PYTHONPATH=src python examples/concurrency_converge.py --fixed-s 4 --adaptive-s 60
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

from rollstream.clock import WallClock
from rollstream.config.schema import LocalEngineConfig, RewardConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.concurrency import ConcurrencyLimit
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.trajectory import Group, Task

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--fixed-s", type=float, default=4.0, help="seconds per fixed slot count")
ARGS.add_argument("--adaptive-s", type=float, default=60.0)
ARGS.add_argument("--capacity", type=int, default=64, help="the engine's slots")
ARGS.add_argument("--hidden", type=int, default=512, help="model width (step cost per row)")
ARGS.add_argument("--window-tokens", type=int, default=1024)


async def graded(task: Task, text: str) -> float:
    return 0.0


def make_model(path: Path, hidden: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=4 * hidden,
                                 vocab_size=256, max_position_embeddings=512,
                                 tie_word_embeddings=True)).eval().save_pretrained(path)
    return path


async def run(model: Path, seconds: float, slots: int, adaptive: bool, window: int) -> None:
    engine = LocalEngine(model, LocalEngineConfig(max_slots=slots, max_seq_len=160, threads=1,
                                                  device="cpu"), engine_id="e0")
    graders = GraderPool(RewardConfig(), lambda _: get_reward(graded))
    clock = WallClock()
    disp = Dispatcher(engines=[engine], params=SamplingParams(max_new_tokens=64),
                      graders=graders, decode=lambda ids: "", clock=clock,
                      lifecycle=Lifecycle(Ledger(), clock), dispatch="fifo",
                      concurrency=(lambda cap: ConcurrencyLimit(capacity=cap, window_tokens=window))
                      if adaptive else None)
    ids = itertools.count()
    stop = time.monotonic() + seconds

    async def feed() -> None:  # keep 2 x capacity requests outstanding (groups of 8)
        running: set[asyncio.Future] = set()
        groups: list[str] = []
        while time.monotonic() < stop:
            while len(running) < 2 * slots // 8 + 1:
                i = next(ids)
                g = Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i % 50, 5, 7, 9),
                                   prompt_text="", reference=""), 8)
                groups.append(g.group_id)
                running.add(asyncio.ensure_future(disp.run_group(g)))
            _, running = await asyncio.wait(running, timeout=0.2,
                                               return_when=asyncio.FIRST_COMPLETED)
        await disp.cancel(groups)  # interrupt what is left; their run_group calls return
        await asyncio.gather(*running)

    async def report() -> None:
        t0 = time.monotonic()
        last = (t0, engine.stats().generated_tokens)
        while True:
            await asyncio.sleep(2.0)
            now, tok = time.monotonic(), engine.stats().generated_tokens
            ctl = disp.queue.limits.get("e0") if disp.queue else None
            lim = f"limit {ctl.limit:3d} ({ctl.phase.value:7s})" if ctl else f"slots {slots:3d}"
            print(f"  t={now - t0:5.1f}s {lim} tokens/s {(tok - last[1]) / (now - last[0]):7.0f}",
                  flush=True)
            last = (now, tok)

    tok0, t0 = engine.stats().generated_tokens, time.monotonic()
    rep = asyncio.create_task(report())
    await feed()
    rep.cancel()
    rate = (engine.stats().generated_tokens - tok0) / (time.monotonic() - t0)
    if adaptive:
        ctl = disp.queue.limits["e0"]
        print("windows (limit: tokens/s):", " ".join(f"{w.limit}:{w.tokens_per_s:.0f}"
                                                      for w in ctl.history))
        print(f"adaptive: mean {rate:.0f} tokens/s, final limit {ctl.limit}")
    else:
        print(f"fixed {slots:3d} slots: {rate:.0f} tokens/s", flush=True)
    await engine.close()
    graders.close()


async def main() -> None:
    args = ARGS.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = make_model(Path(d) / "m", args.hidden)
        slots = 1
        while args.fixed_s > 0 and slots <= args.capacity:
            await run(model, args.fixed_s, slots, False, args.window_tokens)
            slots *= 2
        if args.adaptive_s > 0:
            await run(model, args.adaptive_s, args.capacity, True, args.window_tokens)


if __name__ == "__main__":
    asyncio.run(main())

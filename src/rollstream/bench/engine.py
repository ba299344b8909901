"""Benchmark: the local engine vs Hugging Face ``model.generate`` on a tiny model (CPU, fp32).

    rollstream bench engine [--json OUT] [--quick]

Cases, one run, both sides with the same model, prompts and sampling (temperature 1, no
top-k/top-p, no eos so lengths are fixed):
  * ``fixed_bN``: N requests, prompt 16, 128 new tokens each (N = 1, 16, 64);
  * ``longtail``: 64 requests, log-normal lengths (p99/median = 10, median 24, cap 256).
    HF generates a static batch that runs until its longest member finishes; the local engine
    admits all at once and each row leaves when done. Only useful tokens count on both sides.

And the local engine against itself, ``refill``: 256 requests (long-tail lengths, prompts of
16 to 160 tokens as resumed partial samples have) through 32 rows, so that requests keep
joining running rows; with ``fuse_prefill`` on (their prefill inside the decode pass) and off
(a prefill pass of its own), alternated. Key ``fused_vs_separate_prefill`` (tokens/s ratio).

Each timing is the best of ``repeats`` runs (3, or 1 with --quick): the machines this runs
on are shared, and the minimum is the least noisy estimate of what the code costs.

A benchmark measures; it does not assert. The model is the project's tiny model (random
weights) built with ``rollstream.models.tiny`` when present, else a Qwen2 config of the same
shape; weights do not matter for speed, only shapes do.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

from rollstream.config.schema import LocalEngineConfig, TinyModelConfig
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import GenerateRequest, SamplingParams

THREADS = 2
PROMPT_LEN = 16


@dataclass(slots=True, kw_only=True)
class Case:
    name: str
    num_requests: int
    useful_tokens: int
    local_tok_s: float
    hf_tok_s: float

    @property
    def ratio(self) -> float:
        return self.local_tok_s / self.hf_tok_s


def _build_model(folder: Path) -> Path:
    cfg = TinyModelConfig(seed=0)
    try:
        from rollstream.models.tiny import build_tiny_model
        from rollstream.models.tokenizer import build_char_tokenizer

        return build_tiny_model(cfg, build_char_tokenizer(), folder)
    except ImportError:  # the tiny-model kit is optional for this benchmark
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(cfg.seed)
        config = Qwen2Config(
            vocab_size=64,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            max_position_embeddings=cfg.max_position,
            tie_word_embeddings=True,
        )
        Qwen2ForCausalLM(config).save_pretrained(folder)
        return folder


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, PROMPT_LEN), generator=g).tolist()


def _time_local(
    engine: LocalEngine, prompts: list[list[int]], lengths: list[int], repeats: int
) -> float:
    best = math.inf
    for rep in range(repeats):
        reqs = [
            GenerateRequest(
                request_id=f"b{rep}-{i}",
                prompt_ids=p,
                params=SamplingParams(temperature=1.0, max_new_tokens=n, seed=i),
            )
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        t0 = time.perf_counter()
        outs = engine.generate_many(reqs)
        best = min(best, time.perf_counter() - t0)
        assert [len(o.token_ids) for o in outs] == lengths, "the engine lost tokens"
    return best


def _time_hf(model, prompts: list[list[int]], max_new: int, repeats: int) -> float:
    ids = torch.tensor(prompts)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                eos_token_id=None,
                pad_token_id=0,
            )
        best = min(best, time.perf_counter() - t0)
        assert out.shape[1] == PROMPT_LEN + max_new
    return best


def _longtail_lengths(n: int, median: int, cap: int, seed: int) -> list[int]:
    """n log-normal lengths with p99/median = 10, drawn at evenly spaced quantiles (so a
    small n still has its tail) and shuffled."""
    sigma = math.log(10) / NormalDist().inv_cdf(0.99)
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    lengths = [min(cap, max(1, round(median * math.exp(sigma * x)))) for x in z]
    random.Random(seed).shuffle(lengths)
    return lengths


def _prefill_fusion(folder: Path, quick: bool, repeats: int) -> dict:
    """Requests that keep joining running rows, prefilled in the decode pass or apart."""
    n, rows, cap = (48, 8, 64) if quick else (256, 32, 256)
    rng = random.Random(7)
    lengths = _longtail_lengths(n, 24, cap, seed=7)
    engines = {fuse: LocalEngine(folder, LocalEngineConfig(
        max_slots=rows, max_seq_len=160 + cap, threads=THREADS, device="cpu",
        fuse_prefill=fuse)) for fuse in (True, False)}
    try:
        vocab = engines[True].spec.vocab_size
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(16, 160))]
                   for _ in range(n)]
        best = dict.fromkeys(engines, math.inf)
        for fuse, engine in engines.items():  # warm up
            _time_requests(engine, prompts[:rows], [4] * rows, "w")
        for rep in range(repeats):
            for fuse, engine in engines.items():
                best[fuse] = min(best[fuse], _time_requests(engine, prompts, lengths, f"r{rep}"))
        work = {fuse: e.stats().work for fuse, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()
    return {
        "requests": n, "rows": rows, "prompt_tokens": sum(map(len, prompts)),
        "useful_tokens": sum(lengths),
        "fused_tok_s": sum(lengths) / best[True], "separate_tok_s": sum(lengths) / best[False],
        "fused_prefill_count": work[True]["fused_prefill_count"],
        "prefill_count_fused_engine": work[True]["prefill_count"],
        "prefill_count_separate_engine": work[False]["prefill_count"],
        "prefill_s_separate_engine": work[False]["prefill_s"],
        "busy_s": {"fused": sum(work[True][k] for k in ("prefill_s", "sort_s", "decode_s")),
                   "separate": sum(work[False][k] for k in ("prefill_s", "sort_s", "decode_s"))},
    }


def _time_requests(engine: LocalEngine, prompts: list[list[int]], lengths: list[int],
                   tag: str) -> float:
    reqs = [GenerateRequest(request_id=f"{tag}-{i}", prompt_ids=p,
                            params=SamplingParams(temperature=1.0, max_new_tokens=n, seed=i))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    t0 = time.perf_counter()
    outs = engine.generate_many(reqs)
    elapsed = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == lengths, "the engine lost tokens"
    return elapsed


def main(json_out: Path | None = None, quick: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    batches, new_tokens = ((1, 8), 16) if quick else ((1, 16, 64), 128)
    tail_n, tail_median, tail_cap = (16, 4, 32) if quick else (64, 24, 256)
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        folder = _build_model(Path(tmp) / "model")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        engine = LocalEngine(
            folder,
            LocalEngineConfig(
                max_slots=max(*batches, tail_n),
                max_seq_len=PROMPT_LEN + max(new_tokens, tail_cap),
                threads=THREADS,
                device="cpu",
            ),
        )
        vocab = engine.spec.vocab_size
        try:
            _time_local(engine, _prompts(4, vocab, 99), [8] * 4, 1)  # warm up both
            _time_hf(hf, _prompts(4, vocab, 99), 8, 1)
            cases = []
            for b in batches:
                prompts = _prompts(b, vocab, seed=b)
                t_local = _time_local(engine, prompts, [new_tokens] * b, repeats)
                t_hf = _time_hf(hf, prompts, new_tokens, repeats)
                useful = b * new_tokens
                cases.append(
                    Case(
                        name=f"fixed_b{b}",
                        num_requests=b,
                        useful_tokens=useful,
                        local_tok_s=useful / t_local,
                        hf_tok_s=useful / t_hf,
                    )
                )
            lengths = _longtail_lengths(tail_n, tail_median, tail_cap, seed=0)
            prompts = _prompts(tail_n, vocab, seed=1000)
            t_local = _time_local(engine, prompts, lengths, repeats)
            t_hf = _time_hf(hf, prompts, max(lengths), repeats)
            useful = sum(lengths)
            cases.append(
                Case(
                    name="longtail",
                    num_requests=tail_n,
                    useful_tokens=useful,
                    local_tok_s=useful / t_local,
                    hf_tok_s=useful / t_hf,
                )
            )
        finally:
            engine.shutdown()
        refill = _prefill_fusion(folder, quick, repeats)
    result = {
        "quick": quick,
        "threads": THREADS,
        "repeats": repeats,
        "model": {
            "arch": engine.spec.arch,
            "hidden_size": engine.spec.hidden_size,
            "num_layers": engine.spec.num_layers,
            "vocab_size": vocab,
        },
        "longtail_lengths": {
            "median": float(np.median(lengths)),
            "p99": float(np.percentile(lengths, 99)),
            "max": max(lengths),
            "sum": sum(lengths),
        },
        "cases": {c.name: {**asdict(c), "ratio": c.ratio} for c in cases},
        "local_vs_hf_batch64": cases[len(batches) - 1].ratio,  # the largest fixed batch
        "local_vs_hf_longtail": cases[-1].ratio,
        "refill": refill,
        "fused_vs_separate_prefill": refill["fused_tok_s"] / refill["separate_tok_s"],
    }
    _print_table(cases, result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _print_table(cases: list[Case], result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"local engine vs HF generate (fp32, {THREADS} threads"
        f"{', quick' if result['quick'] else ''})"
    )
    for col in ("case", "requests", "useful tokens", "local tok/s", "HF tok/s", "local/HF"):
        table.add_column(col, justify="right")
    for c in cases:
        table.add_row(
            c.name,
            str(c.num_requests),
            str(c.useful_tokens),
            f"{c.local_tok_s:,.0f}",
            f"{c.hf_tok_s:,.0f}",
            f"{c.ratio:.2f}x",
        )
    Console().print(table)
    r = result["refill"]
    Console().print(
        f"refill ({r['requests']} requests through {r['rows']} rows): prefill fused into "
        f"decode {r['fused_tok_s']:,.0f} tok/s, separate {r['separate_tok_s']:,.0f} tok/s: "
        f"[bold]{result['fused_vs_separate_prefill']:.2f}x[/bold]")

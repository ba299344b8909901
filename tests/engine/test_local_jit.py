"""The local engine's steps run as TorchScript (engine/local/jit.py): the same numbers as the
same ops run eagerly, and no tensor op of a decode step left in Python, where each one would
take the GIL back (and wait for it while another thread of the process runs Python)."""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rollstream.engine.local import jit, model, runner, sampler
from rollstream.engine.local.runner import ModelRunner
from rollstream.engine.local.sampler import seed_key
from rollstream.engine.local.scheduler import Sequence
from rollstream.engine.local.weights import load_folder
from rollstream.engine.protocol import GenerateRequest, SamplingParams


class _Count(TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _runner(folder) -> ModelRunner:
    spec, weights = load_folder(folder, torch.device("cpu"), torch.float32)
    return ModelRunner(spec, weights, max_rows=16, max_seq_len=64, device=torch.device("cpu"),
                       dtype=torch.float32)


def _seqs(n: int, first: int, **params) -> list[Sequence]:
    rng = random.Random(first)
    out = []
    for i in range(first, first + n):
        prompt = [rng.randrange(90) for _ in range(rng.randint(3, 12))]
        req = GenerateRequest(request_id=f"r{i}", prompt_ids=prompt,
                              params=SamplingParams(max_new_tokens=40, seed=i, **params))
        out.append(Sequence(request=req, max_new_tokens=40, seed_key=seed_key(i),
                            future=concurrent.futures.Future()))
    return out


def _steps(folder, **params) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Rows admitted by a prefill, decoded, joined by fused prefills, decoded: every row's
    tokens and logprobs, and the steps' finished rows."""
    r = _runner(folder)
    done = [r.prefill(_seqs(5, 0, **params))]
    for step in range(12):
        done.append(r.decode(_seqs(2, 10 + step, **params) if step in (3, 7) else []))
    n = r.num_rows
    return done, r.rows.tokens[:n].clone(), r.rows.logprobs[:n].clone()


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "top_k": 20}])
def test_scripted_steps_give_what_the_same_ops_give_eagerly(tiny_model_dir, monkeypatch, params):
    scripted = _steps(tiny_model_dir, **params)
    for module in (model, runner, sampler):
        monkeypatch.setattr(module, "scripted", lambda fn: fn)  # the eager ops
    eager = _steps(tiny_model_dir, **params)
    assert scripted[0] == eager[0]
    assert torch.equal(scripted[1], eager[1])
    assert torch.allclose(scripted[2], eager[2], atol=1e-6, rtol=0)


def test_a_step_leaves_almost_no_tensor_op_in_python(tiny_model_dir, monkeypatch):
    """Counted per kind of step: a decode step, one that also admits two prompts, and the
    reads and moves of finishing rows."""
    def count() -> tuple[int, int, int]:
        r = _runner(tiny_model_dir)
        r.prefill(_seqs(8, 0, temperature=1.0))
        r.decode()  # scripted once before counting
        new = _seqs(2, 50, temperature=0.7, top_p=0.9)
        with _Count() as decode:
            r.decode()
        with _Count() as admit:
            r.decode(new)
        with _Count() as finish:
            r.read([0, 1], [3, 3])
            r.release(2, [8, 9], [0, 1])
        return decode.calls, admit.calls, finish.calls

    scripted = count()
    for module in (model, runner, sampler):
        monkeypatch.setattr(module, "scripted", lambda fn: fn)
    eager = count()
    # the counter sees every op of an eager step (two layers here: ~25 ops each, plus the
    # step's tables, attention, sampling and bookkeeping); scripted, one call holds each kind
    assert eager[0] > 100 and eager[1] > eager[0] and eager[2] > 20
    assert scripted[0] <= 2, f"{scripted[0]} tensor ops of a decode step run in Python"
    assert scripted[1] <= 6, f"{scripted[1]} tensor ops of an admitting step run in Python"
    assert scripted[2] == 0, f"{scripted[2]} tensor ops read and move finished rows"


def test_seed_keys_are_the_lowbias32_keys_of_python_ints():
    """Seeded streams stay what they were (resumed requests continue them): the key is the
    lowbias32 hash computed on Python ints."""
    m32 = 0xFFFFFFFF

    def mix(x: int) -> int:
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & m32
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & m32
        return x ^ (x >> 16)

    rng = random.Random(0)
    seeds = [0, 1, -1, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**70 + 5]
    seeds += [rng.randrange(-(2**80), 2**80) for _ in range(200)]
    for seed in seeds:
        assert seed_key(seed) == mix((seed & m32) ^ mix(((seed >> 32) & m32) ^ 0x9E3779B9))


def test_scripting_is_once_per_function():
    assert jit.scripted(sampler.sample) is jit.scripted(sampler.sample)
    assert isinstance(jit.scripted(model._step), torch.jit.ScriptFunction)

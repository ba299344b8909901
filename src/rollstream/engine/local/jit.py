"""TorchScript for the local engine's steps: one call per step that holds no GIL while it
computes.

Eagerly, every tensor op of a step releases the GIL while its kernel runs and takes it back
after, about 250 times per decode step of a tiny model; each time, it waits while another
thread of the process (the trainer, the event loop) runs Python. A scripted function runs
the same ops in TorchScript's interpreter and takes the GIL back once, at its end, so the
numbers are those of the eager ops (the engine tests compare them with transformers') and a
busy interpreter no longer slows the engine down (docs/benchmarks.md, 2026-12-04 at 4ae72fe).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

_SCRIPTED: dict[Callable, Callable] = {}
_LOCK = threading.Lock()


def scripted(fn: Callable) -> Callable:
    """``fn`` compiled by ``torch.jit.script``, once per process."""
    if (out := _SCRIPTED.get(fn)) is None:
        with _LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated for torch.compile
            out = _SCRIPTED.get(fn) or torch.jit.script(fn)
            _SCRIPTED[fn] = out
    return out

"""Code that runs inside the vLLM worker process (passed with ``--worker-extension-cls``).

vLLM mixes :class:`RollstreamWorkerExtension` into its worker class, so its methods are
callable through ``POST /collective_rpc``. Importing it (in the worker) does three things:

* Importing this module enables AMX tiles for the process (``torch.cpu._init_amx()``): on
  these CPUs the eager (``--enforce-eager``) path dies with SIGILL on the first request
  without it. The call is harmless where AMX is absent.
* Logprob semantics. The engine contract (and the local engine) report the logprob of a
  sampled token under ``log_softmax(logits / T)`` (T = 0: plain ``log_softmax``), taken
  *before* top-k/top-p truncation. vLLM offers ``raw_logprobs`` (no temperature) and
  ``processed_logprobs`` (temperature *and* truncation), neither of which is that. Importing
  this module wraps ``vllm.v1.sample.sampler.Sampler.forward`` (vLLM 0.32) so that, in the
  default ``raw_logprobs`` mode, the logprobs it gathers are computed from the logits divided
  by each row's temperature (1 for greedy rows). Sampling itself is untouched. If vLLM's
  sampler changes shape, the wrap is skipped with a warning and logprobs stay raw (the
  contract tests at T != 1 then fail loudly).
* ``rollstream_reload(weights_dir)`` streams every ``*.safetensors`` file of a folder (the
  buckets written by :mod:`rollstream.engine.vllm.weights`) into
  ``worker.reload_weights(weights_iterator=...)``, vLLM's in-place reload that re-runs the
  CPU kernels' weight repacking (calling ``model.load_weights`` directly is wrong on CPU).
  Tensors are read lazily from memory-mapped files, one at a time, so peak extra memory is
  one tensor, not the model.
"""

from __future__ import annotations

import inspect
import logging
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

try:  # a fault boundary of one: a CPU without AMX or a torch without the hook just skips it
    torch.cpu._init_amx()
except Exception:  # noqa: BLE001
    pass

_SAMPLING_EPS = 1e-5


def _tempered_logprobs_sampler() -> None:
    try:
        from vllm.v1.sample.sampler import Sampler
    except ImportError:  # not inside a vLLM worker
        return
    original = Sampler.forward
    if getattr(original, "_rollstream", False):
        return
    params = list(inspect.signature(original).parameters)
    if params[:3] != ["self", "logits", "sampling_metadata"] or \
            not isinstance(getattr(Sampler, "compute_logprobs", None), types.FunctionType):
        log.warning("rollstream: unknown vLLM Sampler; logprobs stay raw (no temperature)")
        return

    def forward(self, logits, sampling_metadata, *args, **kwargs):
        temp = sampling_metadata.temperature
        mode = kwargs.get("logprobs_mode_override") or self.logprobs_mode
        if temp is None or sampling_metadata.all_greedy or mode != "raw_logprobs":
            return original(self, logits, sampling_metadata, *args, **kwargs)
        inv_t = 1.0 / torch.where(temp < _SAMPLING_EPS, 1.0, temp).to(torch.float32)
        # an instance attribute shadows the staticmethod for this call only: forward calls
        # compute_logprobs once, on the raw logits, in raw_logprobs mode
        self.compute_logprobs = lambda x: (x.float() * inv_t[:, None]).log_softmax(dim=-1)
        try:
            return original(self, logits, sampling_metadata, *args, **kwargs)
        finally:
            del self.compute_logprobs

    forward._rollstream = True
    Sampler.forward = forward


_tempered_logprobs_sampler()


def _iter_tensors(weights_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class RollstreamWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def rollstream_reload(self, weights_dir: str) -> dict[str, float]:
        t0 = time.perf_counter()
        reload = self.reload_weights  # type: ignore[attr-defined]  # the worker's method
        reload(weights_iterator=_iter_tensors(weights_dir))
        return {"load_s": time.perf_counter() - t0}

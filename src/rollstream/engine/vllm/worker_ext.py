"""Code that runs inside the vLLM worker process (passed with ``--worker-extension-cls``).

vLLM mixes :class:`RollstreamWorkerExtension` into its worker class, so its methods are
callable through ``POST /collective_rpc``. What it provides:

* Importing this module enables AMX tiles for the process (``torch.cpu._init_amx()``): on
  these CPUs the eager (``--enforce-eager``) path dies with SIGILL on the first request
  without it. The call is harmless where AMX is absent.
* Logprob semantics. The engine contract (and the local engine) report the logprob of a
  sampled token under the distribution it was drawn from: ``logits / T`` truncated by top-k
  then top-p and renormalised (T = 0: plain ``log_softmax``). That is vLLM's
  ``processed_logprobs`` mode (vLLM 0.32, ``v1/sample/sampler.py``: temperature, then
  top-k/top-p in ``TopKTopPSampler``, then ``log_softmax`` of what is left; greedy rows get
  ``log_softmax`` of the raw logits), which the server is launched with
  (``--logprobs-mode processed_logprobs``, ``server.py``). ``rollstream_logprobs_mode()``
  reports the mode the worker's sampler actually runs; the engine refuses a server whose
  answer is anything else, or whose sampler cannot say (a vLLM whose logprob path cannot give
  processed logprobs must not serve training).
* ``rollstream_reload(weights_dir)`` streams every bucket of a version folder (written by
  :mod:`rollstream.sync.shm`, whose reader checks the payload's header) into
  ``worker.reload_weights(weights_iterator=...)``, vLLM's in-place reload that re-runs the
  CPU kernels' weight repacking (calling ``model.load_weights`` directly is wrong on CPU).
  Tensors are read lazily from memory-mapped files, one at a time, so peak extra memory is
  one tensor, not the model.
* ``rollstream_load_adapter(name, path)`` loads a LoRA version's PEFT folder into the one
  adapter slot the server holds (``sync/vllm_lora.py``), in place: the adapter keeps its id,
  so requests in flight that name it continue on the new version. A full reload drops the
  worker's loaded adapters; the next call puts the slot back under its id.
"""

from __future__ import annotations

import time

import torch

from rollstream.sync.shm import iter_folder

try:  # a fault boundary of one: a CPU without AMX or a torch without the hook just skips it
    torch.cpu._init_amx()
except Exception:  # noqa: BLE001
    pass

class RollstreamWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def rollstream_reload(self, weights_dir: str) -> dict[str, float]:
        t0 = time.perf_counter()
        reload = self.reload_weights  # type: ignore[attr-defined]  # the worker's method
        reload(weights_iterator=iter_folder(weights_dir))
        return {"load_s": time.perf_counter() - t0}

    def rollstream_load_adapter(self, name: str, path: str) -> dict[str, float]:
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        ids = self.list_loras()  # type: ignore[attr-defined]  # the worker's method
        # the id the API server gave the slot when it was registered; a full reload drops
        # the loaded adapters, so it is remembered from the first load, right after that
        lora_id = getattr(self, "_rollstream_lora_id", None)
        if lora_id is None and len(ids) == 1:
            (lora_id,) = ids
        if lora_id is None or not ids <= {lora_id}:
            raise RuntimeError(f"rollstream: expected the one registered LoRA adapter, found "
                               f"{ids} (remembered {lora_id})")
        self._rollstream_lora_id = lora_id
        self.add_lora(LoRARequest(  # type: ignore[attr-defined]
            lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=True))
        return {"load_s": time.perf_counter() - t0}

    def rollstream_logprobs_mode(self) -> dict[str, str]:
        """The logprobs mode the worker's sampler runs (``processed_logprobs`` expected);
        raises when this vLLM's model runner has no sampler that says."""
        sampler = getattr(getattr(self, "model_runner", None), "sampler", None)
        mode = getattr(sampler, "logprobs_mode", None)
        inner = getattr(getattr(sampler, "topk_topp_sampler", None), "logprobs_mode", mode)
        if not isinstance(mode, str) or inner != mode:
            raise RuntimeError(
                f"rollstream: this vLLM's sampler ({type(sampler).__name__}) does not report "
                "one logprobs mode; cannot confirm it returns processed logprobs")
        return {"logprobs_mode": mode}

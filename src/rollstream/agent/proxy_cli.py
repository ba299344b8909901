"""``rollstream proxy``: the embedded engine behind the agent proxy, for agents run by hand
(``AgentProxy``, ``proxy.py``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rollstream.agent.proxy import AgentProxy
from rollstream.config.tasks import ProxyConfig


def serve(model_dir: Path, *, port: int, num_sessions: int, out: Path | None,
          max_slots: int = 16, limits: ProxyConfig = ProxyConfig()) -> None:
    """``rollstream proxy``: the embedded engine on ``model_dir`` behind the proxy, with
    ``num_sessions`` open sessions (their URL and keys printed), until SIGINT or SIGTERM;
    then every session's samples are written to ``out`` (JSON lines). ``limits``: the
    proxy's caps (``agent.proxy`` of a run's config)."""
    import signal

    from transformers import AutoTokenizer

    from rollstream.config.schema import EngineConfig, LocalEngineConfig
    from rollstream.engine import build_engine
    from rollstream.models.folder import validate_model_folder

    folder = validate_model_folder(Path(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(folder)

    async def main() -> None:
        engine_cfg = EngineConfig(kind="local", local=LocalEngineConfig(max_slots=max_slots))
        engine = build_engine(engine_cfg, folder, engine_id="local-0")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            async with AgentProxy([engine], tokenizer, port=port, limits=limits,
                                  context_tokens=engine_cfg.context[1]) as proxy:
                handles = [proxy.open_session(f"session-{i}") for i in range(num_sessions)]
                print(f"base_url {proxy.base_url}", flush=True)
                for h in handles:
                    print(f"api_key {h.api_key}", flush=True)
                await stop.wait()
                records = [
                    {"session": i, "sample": j, "started_because": s.started_because,
                     "num_calls": s.num_calls, "messages": s.messages,
                     "prompt_ids": s.prompt_ids,
                     "segments": [{"kind": seg.kind.value, "token_ids": seg.token_ids,
                                   "logprobs": seg.logprobs, "versions": seg.versions}
                                  for seg in s.segments],
                     "contexts": [{"num_segments": c.num_segments,
                                   "token_ids": list(c.token_ids)} for c in s.contexts]}
                    for i, h in enumerate(handles)
                    for j, s in enumerate(proxy.close_session(h.api_key))]
        finally:
            await engine.close()
        if out is not None:
            out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{len(records)} samples from {num_sessions} sessions"
              + (f" written to {out}" if out is not None else ""), flush=True)

    asyncio.run(main())

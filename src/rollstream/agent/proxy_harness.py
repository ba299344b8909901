"""An external agent as a rollout harness: OpenAI-SDK code driving training episodes.

For a task whose ``Task.harness`` is ``"openai"``, :class:`ProxyHarness` opens a session of
an :class:`~rollstream.agent.proxy.AgentProxy` (started on 127.0.0.1 in the run's process the
first time it is needed) bound to the sample, and runs the source's agent function with the
session's base URL and key: ordinary code written against the official ``openai`` SDK, which
keeps its own conversation, runs its own tools and decides when it is done. A source names
its agent by import path (``module:function``, an :class:`OpenAIAgent`), resolved and checked
when the harness is built. The proxy renders each call with the chat template and stitches
the calls into the sample itself by dialogue prefix matching; every model turn is generated
by ``Dispatcher.episode_turn`` for that sample (gate, routing, interrupts with per-token
versions, retries, spans), so an external agent's episodes are trained exactly like the
built-in loop's. The episode's reward is the source's reward on the last model turn
(``Sample.answer``), through the grader pool. An agent may return a JSON object, the episode's
record (at most ``MAX_RECORD_BYTES`` as JSON), which the reward reads as its ``episode``
keyword (``Sample.episode_record``): a verifiers environment's agent returns its rollout's
state, which its rubric grades with the group's (``agent/verifiers_env.py``). An agent that
raises with a ``record`` attribute when a budget ended its episode is graded from it.

Where the agents run (``agent.harness_workers``): 0, as coroutines in the run's process;
N > 0, in a pool of N long-lived worker processes (``ProcessWorkers``, the reward pool's,
``spawn``-ed at the first episode and reused for every later one; on ``runtime.kind: ray``,
``RayWorkers``' actors, on the driver's node), one episode per worker at a time, so at most
N of these episodes run at once and the others wait for a worker. A worker gets the agent's
import path, the session (the proxy's loopback URL and the episode's key), the task and the
sampling settings (over its pipe, or as the actor call's arguments), runs the agent on an
event loop of its own and reports how it ended; the agent reaches the proxy over 127.0.0.1.
A worker that dies during an episode, or whose agent runs past ``agent.max_wall_s`` (it is
SIGKILLed, or ``ray.kill``-ed: blocking code cannot delay it), is replaced and only that
episode's sample fails, with the reason. ``close()`` stops every worker.

What fails a sample here, with the reason in the ledger: the agent raising, running past
``agent.max_wall_s`` or its worker process dying; a call the session refuses (the agent
rewrote its history, or its first messages are not the task's prompt: a training episode is
one trajectory); no model turn at all. The budgets end the episode like the built-in loop's:
each call's ``max_tokens`` is capped by ``agent.max_turn_tokens`` (the agent is given it as
``sampling.max_new_tokens``), and a call past ``agent.max_turns`` or
``sampling.max_new_tokens`` is refused with HTTP 400 and the episode ends as ``max_turns`` /
``max_tokens``.

The agent may run its source's tools (``tool_list()``, under ``agent.tool_timeout_s`` and
``agent.max_tool_concurrency``) through its session (``SessionHandle.call_tool``); the
episode records each call. An episode restored from a checkpoint with tokens is run again
from its task: its session answers the agent's calls and tool calls from the record until
the agent reaches where the episode stood, then goes on live (``agent/proxy_episode.py``);
an agent whose calls differ from the record, or that ends before reaching that point, fails
the sample with the first difference. The agent's own side effects happen again.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from rollstream.agent.loop import Budgets
from rollstream.agent.proxy import AgentProxy, Binding, SessionHandle
from rollstream.agent.proxy_episode import BoundTurns, replay_reason
from rollstream.agent.tools import ToolManager
from rollstream.config.tasks import ProxyConfig
from rollstream.engine import SamplingParams
from rollstream.engine.protocol import OnTokens
from rollstream.reward.workers import CallTimeout, PoolClosed, WorkerDied, Workers
from rollstream.trajectory import Sample, SampleStatus, SegmentKind, Task

if TYPE_CHECKING:
    from rollstream.rollout.harness import EpisodeHost, TurnOutput

OPENAI = "openai"  # Task.harness of episodes driven by an OpenAI-SDK agent


MAX_RECORD_BYTES = 1 << 20  # an episode's record (what its agent returned), as JSON


class OpenAIAgent(Protocol):
    async def __call__(self, session: SessionHandle, task: Task,
                       sampling: SamplingParams) -> Any:
        """Run one episode of ``task`` with the ``openai`` SDK against ``session`` (its
        ``base_url`` and ``api_key``), sampling with ``sampling``; return when it is done,
        with the episode's record (a JSON object) or anything else (not kept)."""


class OpenAIAgentSource(Protocol):
    """A source whose episodes an OpenAI-SDK agent drives; a ``tool_list()`` method, when it
    has one, gives the tools its agents may run through their sessions."""

    name: str
    parser: Any  # the tool-call format its model writes (a ToolCallParser)
    agent: str | OpenAIAgent  # its import path ``module:function``, or a picklable agent


class AgentFailed(Exception):
    """The agent raised in its worker process (the message: ``Type: message``); ``record``:
    the exception's, if it had one (:func:`record_of`)."""

    def __init__(self, message: str, record: Any = None) -> None:
        super().__init__(message)
        self.record = record


def record_of(e: BaseException) -> Any:
    """The episode's record an agent raised with (``record`` on the exception: the episode
    is graded from it if a budget ended it)."""
    return getattr(e, "record", None)


@functools.cache
def resolve_agent(path: str) -> OpenAIAgent:
    """The ``async def`` function at import path ``module:function``, checked
    (``agent/episodes.py``: a ValueError or TypeError that names what is wrong)."""
    from rollstream.agent.episodes import check_agent

    return check_agent(path)


def _agent(agent: str | OpenAIAgent) -> OpenAIAgent:
    return resolve_agent(agent) if isinstance(agent, str) else agent


def run_agent(agent: str | OpenAIAgent, session: SessionHandle, task: Task,
              sampling: SamplingParams) -> tuple[str | None, Any]:
    """One episode in a harness worker process: the agent (at an import path), on an event
    loop of its own. (None, what it returned) when it returned, else (why it raised, the
    record it raised with: :func:`record_of`) (the worker lives on)."""
    try:
        return None, asyncio.run(_agent(agent)(session, task, sampling))
    except Exception as e:  # noqa: BLE001 - fault boundary: the episode, reported to the run
        return f"{type(e).__name__}: {e}"[:2000], record_of(e)


class ProxyHarness:
    """Runs the episodes of sources whose agents talk to the proxy (module docstring).
    ``workers``: None runs the agents as coroutines here; else the pool they run in (the
    run's ``build_workers``, role ``harness``), which the harness closes. ``context_tokens``
    and ``limits``: the proxy's (:class:`AgentProxy`); ``tool_timeout_s`` and
    ``max_tool_concurrency``: each source's tools' (``ToolManager``)."""

    def __init__(self, *, tokenizer: Any, sources: Mapping[str, OpenAIAgentSource],
                 budgets: Budgets, workers: Workers | None = None,
                 context_tokens: int | None = None, limits: ProxyConfig = ProxyConfig(),
                 tool_timeout_s: float = 30.0, max_tool_concurrency: int | None = None) -> None:
        self.tokenizer, self.budgets = tokenizer, budgets
        self.context_tokens, self.limits = context_tokens, limits
        self.sources = dict(sources)
        self.agents = {name: _agent(src.agent) for name, src in self.sources.items()}
        self.tools = {name: ToolManager(src.tool_list(), timeout_s=tool_timeout_s,
                                        max_concurrency=max_tool_concurrency)
                      for name, src in self.sources.items() if hasattr(src, "tool_list")}
        self.workers = workers
        self.proxies: dict[str, AgentProxy] = {}  # per source: its tool-call format
        self._starting: asyncio.Lock | None = None

    async def _proxy(self, dispatcher: EpisodeHost, name: str) -> AgentProxy:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if name not in self.proxies:
                proxy = AgentProxy(dispatcher.engines, self.tokenizer,
                                   parser=self.sources[name].parser,
                                   context_tokens=self.context_tokens, limits=self.limits)
                await proxy.start()
                self.proxies[name] = proxy
        return self.proxies[name]

    async def close(self) -> None:
        if self.workers is not None:
            self.workers.close()  # their episodes end with PoolClosed
        for proxy in self.proxies.values():
            await proxy.stop()
        self.proxies.clear()

    async def _drive(self, source: str, session: SessionHandle, task: Task,
                     sampling: SamplingParams) -> Any:
        """Run ``source``'s agent on one episode, here or in a worker (module docstring);
        what it returned."""
        b = self.budgets
        if self.workers is None:
            async with asyncio.timeout(b.max_wall_s):
                return await self.agents[source](session, task, sampling)
        error, returned = await self.workers.call(
            run_agent, (self.sources[source].agent, session, task, sampling), b.max_wall_s)
        if error is not None:
            raise AgentFailed(error, returned)
        return returned

    async def run(self, sample: Sample, dispatcher: EpisodeHost, params: SamplingParams) -> None:
        move = dispatcher.lifecycle.move
        source = self.sources.get(sample.task.source)
        if source is None:
            move(sample, SampleStatus.FAILED, f"source {sample.task.source!r} has no OpenAI "
                 f"agent (such sources: {', '.join(sorted(self.sources)) or 'none'})")
            return
        b = self.budgets
        binding = Binding(prompt_ids=list(sample.task.prompt_ids), segments=sample.segments,
                          turns=sample.turns, generate=_bound_turns(dispatcher, sample),
                          max_total_tokens=b.max_total_tokens, max_turns=b.max_turns,
                          tools=self.tools.get(sample.task.source), contexts=sample.contexts,
                          recorded=len(sample.segments))  # restored: replayed first
        proxy = await self._proxy(dispatcher, sample.task.source)
        handle = proxy.open_session(sample.uid, binding=binding)
        error: str | None = None
        returned: Any = None
        try:
            returned = await self._drive(sample.task.source, handle, sample.task,
                                         replace(params, max_new_tokens=b.max_turn_tokens))
        except (TimeoutError, CallTimeout):
            error = f"the agent ran past agent.max_wall_s = {b.max_wall_s} s" + (
                "" if self.workers is None else " (its worker process was killed and replaced)")
        except WorkerDied as e:  # it is replaced (unless workers cannot start at all)
            error = f"the agent's {e}"
        except PoolClosed:
            error = "the harness workers were closed during the episode"
        except AgentFailed as e:
            error, returned = f"the agent raised {e}", e.record
        except Exception as e:  # noqa: BLE001 - fault boundary: this sample only
            error, returned = f"the agent raised {type(e).__name__}: {e}", record_of(e)
        finally:  # a call still generating finishes its turn first (the agent was cut off)
            await proxy.end_session(handle.api_key)
        if sample.status.is_terminal() or dispatcher.cancelled(sample.group_id) or (
                dispatcher.fatal is not None):
            return  # the dispatcher gave up on it, or the run is ending: recorded elsewhere
        if binding.refused is not None:
            move(sample, SampleStatus.FAILED, f"episode refused: {binding.refused}")
        elif error is None and (diverged := replay_reason(binding)) is not None:
            move(sample, SampleStatus.FAILED, f"episode refused: {diverged}")
        elif error is not None and binding.ended is None:
            move(sample, SampleStatus.FAILED, error)
        elif not sample.segments or sample.segments[-1].kind is not SegmentKind.POLICY:
            move(sample, SampleStatus.FAILED, "the agent ended without completing a model turn")
        else:  # done, or a budget ended it (the agent saw its call refused, and maybe raised)
            self._finish(sample, dispatcher, binding.ended or "done", returned)

    def _finish(self, sample: Sample, dispatcher: EpisodeHost, reason: str,
                returned: Any) -> None:
        """GENERATED, keeping what the agent returned as the episode's record when it is a
        JSON object; one that is not JSON, or too large, fails the sample."""
        if isinstance(returned, dict):
            try:
                size = len(json.dumps(returned, allow_nan=False))
            except (TypeError, ValueError) as e:
                dispatcher.lifecycle.move(sample, SampleStatus.FAILED, "the agent returned an "
                                          f"episode record that is not JSON: {e}")
                return
            if size > MAX_RECORD_BYTES:
                dispatcher.lifecycle.move(sample, SampleStatus.FAILED, "the agent returned an "
                                          f"episode record of {size} bytes as JSON, over "
                                          f"{MAX_RECORD_BYTES}")
                return
            sample.episode_record = returned
        dispatcher.finish(sample, reason)


def _bound_turns(dispatcher: EpisodeHost, sample: Sample) -> BoundTurns:
    async def generate(params: SamplingParams, rid: str,
                       on_tokens: OnTokens | None) -> TurnOutput | None:
        return await dispatcher.episode_turn(sample, params, on_tokens=on_tokens)

    return generate

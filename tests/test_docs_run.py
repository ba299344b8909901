"""The Getting-started pages run: every ``rollstream`` command of their shell blocks and every
Python block, page by page in one working folder, as a reader following them would.

Only the size is hidden from the reader: the folder's ``examples/`` is the project's, with each
config the pages run merged with the smallest shape (a two-layer kit model without a warm
start, short responses, two steps of four groups, every group trained whatever its rewards, so
that an untrained model cannot stop the run; each simulator scenario one step), and a config a
page writes gets the same merge. The rows the pages read (``train.jsonl``) are written first.
What runs is the pages' code: the commands' words, the blocks' text. A command that cannot run
inside a test is in NOT_RUN with the reason; a command the pages add runs, or this test
fails."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import warm
from tests.test_docs import GETTING_STARTED, _commands

ROOT = Path(__file__).resolve().parents[1]
# the pages' order as a reader's; your-data.md writes my.yaml before quickstart.md trains it
PAGES = ("README.md", "docs/your-data.md", *(p for p in GETTING_STARTED[1:]
                                              if p != "docs/your-data.md"))

SMALLEST = {  # every config the pages train
    "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 192,
                       "max_position": 256},
              "warm_start": {"steps": 0}},
    "engine": {"local": {"max_slots": 64, "max_seq_len": 256}},
    "sampling": {"max_new_tokens": 48},
    "rollout": {"filter_zero_variance": False},
    "train": {"steps": 2, "groups_per_step": 4, "micro_batch_tokens": 1024},
    "eval": {"samples_per_task": 2, "every": 0},
    "tasks": {"num_eval": 8},
    "monitor": {"progress": False},
    "max_wall_s": 300,
}
TICK = {"tasks": {"sources": [{"kind": "tick", "max_items": 6}]}}
TALLY = {"agent": {"max_turns": 4, "max_turn_tokens": 16}}
RAY_LOCAL = "train examples/tick.yaml runtime.kind=ray engine.num_engines=2"
SHAPES = {"tick.yaml": [SMALLEST, TICK], "agent.yaml": [SMALLEST, TALLY],
          "agent_openai.yaml": [SMALLEST, TALLY], "agent_env.yaml": [SMALLEST],
          "sim/kimi_k2_512.yaml": [{"steps": 1}], "sim/agentic_drift_32.yaml": [{"steps": 1}]}

# a command (its first words, as on the page) -> why a test cannot run it as written
NOT_RUN = {
    "bench NAME": "a benchmark runs for minutes; tests/bench/ runs each on its smallest shape",
    "bench modes": "a benchmark runs for minutes; tests/bench/test_modes.py runs it small",
    "engines runs/<name>": "needs a live run: tests/rollout/test_control.py drains an engine",
    "proxy MODEL_DIR": "a server until stopped: tests/agent/test_proxy.py starts and stops it",
    "train examples/tick.yaml runtime.kind=ray runtime.ray.address=HEAD:6379":
        "joins a running Ray cluster at HEAD:6379",
    RAY_LOCAL: "test_the_ray_page_runs_on_one_machine below (marker ray)",
}
# a block that is a fragment of a page's story, not a program -> where it is checked
FRAGMENTS = {'rollstream.run("my.yaml", datasets={"guess": rows}':
             "the page's names in a call; tests/test_docs.py compiles it"}
# a file a page includes (`--8<--`) -> the test that runs it
INCLUDED = {"examples/train_api.py": "tests/test_api.py runs it on the smallest shape"}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else copy.deepcopy(value)
    return out


def _shrink(config: dict, shapes: list[dict], cache: Path) -> dict:
    for shape in shapes:
        config = _merge(config, shape)
    if "model" in config:  # a training config, not a sim scenario
        config = _merge(config, {"model": {"cache_dir": str(cache)}})
    return config


def _workdir(tmp: Path, cache: Path) -> Path:
    shutil.copytree(ROOT / "examples", tmp / "examples")
    for name, shapes in SHAPES.items():
        path = tmp / "examples" / name
        path.write_text(yaml.safe_dump(_shrink(yaml.safe_load(path.read_text()), shapes, cache)))
    # the rows the README and your-data.md read: the example's generated rows
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from train_api import count_rows
    finally:
        sys.path.remove(str(ROOT / "examples"))
    lines = "".join(f"{json.dumps(row)}\n" for row in count_rows(200))
    for rel in ("train.jsonl", "data/train.jsonl"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(lines)
    return tmp


def _fences(text: str) -> list[tuple[str, str]]:
    """Every fenced block as (language, body), in page order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def _run(argv: list[str], cwd: Path, env_vars: dict[str, str], log: list[str]) -> str:
    """``python *argv`` in ``cwd`` (``PYTHONPATH`` relative to it), started warm
    (tests/warm.py): each command would spend most of its seconds importing torch,
    transformers and the CLI."""
    paths = [str(cwd / p) for p in [env_vars.get("PYTHONPATH")] if p]
    env = dict(os.environ, COLUMNS="100",
               PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    child = warm.start(argv, cwd=cwd, env=env)
    try:
        child.wait(timeout=420)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    text = child.output()
    assert child.returncode == 0, f"{argv} (exit {child.returncode}): {text[-4000:]}"
    log.append(f"{time.monotonic() - start:5.1f} s  {' '.join(argv)}")
    return text


def _file_of(body: str, ext: str) -> str | None:
    """The file a block says it is, by its first line (``# my_pkg/envs.py``)."""
    first = body.splitlines()[0] if body.strip() else ""
    m = re.match(rf"# ([\w/.-]+\.{ext})(:|$)", first)
    return m.group(1) if m else None


def _python(page: str, body: str, work: Path, log: list[str]) -> None:
    if body.startswith("--8<--"):
        included = body.split('"')[1]
        assert included in INCLUDED, f"{page} includes {included}: run it here or name its test"
        return
    name = _file_of(body, "py")
    if name:  # a module of the reader's: later commands import it
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(body)
        _run(["-c", f"import {name.removesuffix('.py').replace('/', '.')}"], work,
             {"PYTHONPATH": "."}, log)
    elif not any(body.startswith(key) for key in FRAGMENTS):
        # a program, run as a script: its reward workers import it from its file
        script = work / f"{Path(page).stem}_example.py"
        script.write_text(body)
        _run([script.name], work, {}, log)


def _shell(body: str, work: Path, seen: set, log: list[str],
           not_run: dict[str, str] = NOT_RUN) -> None:
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        env = dict(re.findall(r"^([A-Z_]+)=(\S*)\s+", line))
        line = re.sub(r"^([A-Z_]+=\S*\s+)+", "", line)
        for argv in _commands(line):
            skipped = [key for key in not_run if line.startswith(f"rollstream {key}")]
            if skipped:
                seen.add(skipped[0])
            elif tuple(argv) not in seen:  # a command on two pages runs once
                seen.add(tuple(argv))
                _run(["-m", "rollstream.cli", *argv], work, env, log)


def _follow(page: str, work: Path, cache: Path, seen: set, log: list[str]) -> None:
    for lang, body in _fences((ROOT / page).read_text()):
        if lang == "python":
            _python(page, body, work, log)
        elif lang == "yaml" and (name := _file_of(body, "yaml")):
            (work / name).write_text(yaml.safe_dump(_shrink(yaml.safe_load(body),
                                                            [SMALLEST], cache)))
        elif lang == "":
            _shell(body, work, seen, log)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 60-130 s on a 2-core machine at a load of 4-9
def test_the_getting_started_pages_run_as_written(tmp_path: Path, tiny_run_cache: Path) -> None:
    work = _workdir(tmp_path, tiny_run_cache)
    seen: set = set()
    log: list[str] = []
    for page in PAGES:
        _follow(page, work, tiny_run_cache, seen, log)
    assert set(NOT_RUN) <= seen, set(NOT_RUN) - seen  # every exception is still on a page
    ran = "\n".join(log)
    for needed in ("README_example.py", "import my_rewards", "train my.yaml",
                   "train examples/tick.yaml train.checkpoint_every=10 --resume",
                   "train examples/agent_openai.yaml", "export runs/tick-demo --out out",
                   "sim examples/sim/agentic_drift_32.yaml", "import my_pkg.envs",
                   "train guess.yaml", "train examples/agent_env.yaml"):
        assert needed in ran, ran
    for run in ("tick-demo", "mine", "my-run", "agent-demo", "agent-openai-demo", "guess",
                "agent-env-demo"):
        summary = json.loads((work / "runs" / run / "summary.json").read_text())
        assert summary["steps"] == 2, (run, summary)
    assert (work / "runs" / "tick-demo" / "report.html").is_file()
    assert (work / "out" / "config.json").is_file()  # the exported model folder


@pytest.mark.slow
@pytest.mark.ray
def test_the_ray_page_runs_on_one_machine(tmp_path: Path, tiny_run_cache: Path) -> None:
    """The Ray page's one-machine command: a local Ray of the run's own, stopped at its end,
    its logs moved into the run directory."""
    page = (ROOT / "docs" / "ray-cluster.md").read_text()
    section = page.split("## On one machine\n", 1)[1].split("\n## ", 1)[0]
    (block,) = [body for lang, body in _fences(section) if lang == ""]
    assert block.strip() == f"rollstream {RAY_LOCAL}"
    work = _workdir(tmp_path, tiny_run_cache)
    log: list[str] = []
    _shell(block, work, set(), log, not_run={})
    run = work / "runs" / "tick-demo"
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert (run / "ray-logs").is_dir()

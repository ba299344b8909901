"""An error raised into a run's event loop (a signal handler's exception, as pytest-timeout
raises one, lands most often in the loop's wait on its selector) ends the run with that error.
The loop's teardown then cancels every task at once: the rollout must not wait for group
tasks cancelled with it (it once polled for them every 10 ms, forever, and the process, its
SIGTERM handled by the run, could only be killed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from rollstream.data.ledger import read_ledger

RUN = textwrap.dedent("""
    import asyncio, faulthandler, selectors, sys, threading, time
    from pathlib import Path
    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    model, root = sys.argv[1], Path(sys.argv[2])

    class Boom(BaseException):  # as pytest-timeout's Failed: not an Exception
        pass

    raise_now = threading.Event()
    select = selectors.EpollSelector.select

    def select_or_raise(self, timeout=None):  # where a signal handler's raise lands most:
        if raise_now.is_set() and threading.current_thread() is threading.main_thread():
            raise_now.clear()                # the run's loop waiting on its selector
            loops.append(asyncio.get_event_loop())
            raise Boom("raised into the event loop")
        return select(self, 0.05 if timeout is None else min(timeout, 0.05))

    def tasks_left() -> None:  # what the teardown still waits for, if it hangs
        for t in asyncio.all_tasks(loops[0]):
            c, chain = t.get_coro(), []
            while c is not None and getattr(c, "cr_frame", None) is not None:
                chain.append(f"{c.cr_code.co_name}:{c.cr_frame.f_lineno}")
                c = c.cr_await
            print("task left:", t.get_name(), " > ".join(chain), file=sys.stderr, flush=True)

    selectors.EpollSelector.select = select_or_raise

    def after_first_step():  # then groups are in flight (async): raise into the loop
        metrics = root / "boom" / "metrics.jsonl"
        while not (metrics.is_file() and '"kind":"train"' in metrics.read_text()):
            time.sleep(0.05)
        raise_now.set()
        time.sleep(30)  # still running: say where it hangs, then end it
        loops[0].call_soon_threadsafe(tasks_left)
        faulthandler.dump_traceback_later(5, exit=True)

    loops = []
    cfg = load_config(None, [
        f"model.path={model}", f"run_root={root}", "name=boom", "train.steps=1000",
        "monitor.progress=false", "monitor.report=false",
        "tasks.sources=[{kind: tick, max_items: 40}]", "tasks.num_eval=4",
        "eval.samples_per_task=1", "sampling.max_new_tokens=32", "rollout.group_size=4",
        "train.groups_per_step=2", "rollout.mode=async", "rollout.filter_zero_variance=false"])
    threading.Thread(target=after_first_step, daemon=True).start()
    run_training(cfg)
""")


def test_an_error_raised_into_the_event_loop_ends_the_run_with_it(tmp_path, kit_model):
    proc = subprocess.run([sys.executable, "-c", RUN, str(kit_model), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Boom: raised into the event loop" in proc.stderr, \
        proc.stderr[-3000:]
    rows = read_ledger(tmp_path / "boom" / "ledger.jsonl")
    assert any(r.status == "trained" for r in rows)
    # the groups in flight when it was raised are recorded, not dropped
    assert any(r.status == "aborted" for r in rows), sorted({r.status for r in rows})

"""The package logger as the command line sets it up: messages read as they did when they
were printed (``warning: ...``), go to stderr, and ``--log-level`` chooses which show."""

from __future__ import annotations

import logging

import pytest

from rollstream.cli import main
from rollstream.logs import LOGGER, configure


@pytest.fixture(autouse=True)
def _restore_logger():
    logger = logging.getLogger(LOGGER)
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = handlers, level


def test_messages_read_as_the_printed_lines_and_the_level_filters(capsys):
    configure("info")
    log = logging.getLogger("rollstream.runtime.build")  # a module's logger: a child
    log.info("checkpoint: runs/x/checkpoints/step_000002 (generation held 3 ms)")
    log.warning("skipped task t/1: no prompt")
    log.debug("not shown at info")
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays the command's results and the progress line
    assert err == ("checkpoint: runs/x/checkpoints/step_000002 (generation held 3 ms)\n"
                   "warning: skipped task t/1: no prompt\n")
    configure("warning")  # again: replaces, never doubles
    log.info("hidden")
    log.warning("shown once")
    assert capsys.readouterr().err == "warning: shown once\n"
    with pytest.raises(ValueError, match="allowed debug, info, warning, error"):
        configure("loud")


def test_the_cli_sets_the_level_before_or_after_the_command(capsys):
    logger = logging.getLogger(LOGGER)
    assert main(["--log-level", "warning", "config", "eval.every"]) == 0
    assert logger.level == logging.WARNING
    assert main(["config", "eval.every", "--log-level", "debug"]) == 0
    assert logger.level == logging.DEBUG
    assert main(["config", "eval.every"]) == 0
    assert logger.level == logging.INFO  # the default
    assert len([h for h in logger.handlers if type(h).__module__ == "rollstream.logs"]) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "config"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err

"""The package's logger. Every module logs to ``logging.getLogger(__name__)``, a child of
``rollstream``, and the command line configures that logger once (``--log-level``, default
``info``); :func:`rollstream.run` does the same when the application has configured no
logging of its own. A message reads as rollstream's lines always read: an info message is its
text (``checkpoint: runs/x/checkpoints/step_000010 ...``), a warning or an error is
``warning: <text>`` / ``error: <text>``. Messages go to standard error, beside a command's
results and the progress line on standard output; they are looked up at each message, so the
live progress bar, which redirects standard error while it draws, shows them above itself.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "rollstream"
LEVELS = ("debug", "info", "warning", "error")


class _Lines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno == logging.INFO else f"{record.levelname.lower()}: {text}"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each message (as logging's last-resort handler)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr


def configure(level: str = "info") -> None:
    """Show the package's messages of ``level`` and above (one of :data:`LEVELS`) on standard
    error; calling it again replaces the earlier setting."""
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: allowed {', '.join(LEVELS)}")
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(_Lines("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())


def configure_unless_configured() -> None:
    """:func:`configure` at ``info`` unless the package logger or an ancestor already has a
    handler (an application that set up logging keeps its own)."""
    if not logging.getLogger(LOGGER).hasHandlers():
        configure()

"""The library's one logger: `log.get(__name__)` in every module that reports something.

A line is the message alone, as the run's console has always shown it (`[trainer] resumed
from ...`: the tag is part of the message), on stdout, and on stderr from WARNING up. Only
global rank 0 (`RANK` unset or 0) writes, so a line is not repeated by every learner rank;
a call that must be seen from every rank passes `extra=EVERY_RANK`. `DAPO_MEGA_LOG_LEVEL`
(default INFO) sets the level. The step line (`records.Recorder`) and what the commands print
as their result (`dapo-mega plan`, `eval`, `ablate`, `audit`, the ledger report) are output,
not log lines: they stay prints.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["EVERY_RANK", "ROOT", "get"]

ROOT = "dapo_mega"
EVERY_RANK = {"every_rank": True}
"""`logger.info(..., extra=EVERY_RANK)`: written on every rank, not rank 0 only."""


class _Console(logging.Handler):
    """The message alone, on the sys.stdout / sys.stderr of the moment it is written (so a
    test's captured streams see it), flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "every_rank", False) and os.environ.get("RANK", "0") not in ("", "0"):
            return
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must not raise (a closed stream at exit)
            self.handleError(record)


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Console) for h in root.handlers):
        root.addHandler(_Console())
        root.setLevel(os.environ.get("DAPO_MEGA_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return root


def get(name: str) -> logging.Logger:
    """The logger of module `name` (a child of `dapo_mega`, which writes to the console)."""
    _root()
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")

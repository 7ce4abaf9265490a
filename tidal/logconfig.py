"""How Tidal's own processes write their log lines: the stdlib ``logging``, one handler.

Every module logs through ``logging.getLogger(__name__)`` (loggers under ``tidal``); nothing
of Tidal calls ``print`` for a line a tool or a user reads in a log. ``install`` gives the
``tidal`` logger one handler, once per process: a record becomes one line on the process's
*current* standard error (a worker's log file; what a test's ``capsys`` captured), in the
words Tidal has always used, ``tidal: warning: ...`` / ``tidal: error: ...`` (``tidal: ...``
for information). The records do not also propagate to the root logger: a script that
configures logging for itself does not print each of Tidal's lines twice; it can attach its
own handler to ``logging.getLogger("tidal")`` to take them as records instead.

Called by the processes Tidal starts or runs in (a worker's ``Trainer`` under ``tidal run``,
the coordinator, the CLI); a script run alone is never configured behind its back.
"""

from __future__ import annotations

import logging
import sys

#: The logger every Tidal module's logger descends from.
ROOT = "tidal"


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when the record is emitted (the
    stream ``logging.lastResort`` uses too), not as it was when the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - set by StreamHandler.__init__
        pass


class LineFormatter(logging.Formatter):
    """``tidal: warning: message`` (the level's name in lower case; none for INFO)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return f"tidal: {text}"
        return f"tidal: {record.levelname.lower()}: {text}"


def install(level: int = logging.INFO) -> logging.Logger:
    """Give the ``tidal`` logger its one handler (module doc); idempotent."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(LineFormatter())
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger

"""flashoverlap's messages, through the standard :mod:`logging` module under the ``flashoverlap`` logger.

INFO: kernel compiles (with their progress: a first call can stop a minute for one), first-use
trials, and with ``FLASHOVERLAP_LOG=1`` the path each kind of call takes; WARNING: what a user
may want to act on. While the application has configured no logging (no handler on the root
logger or on ``flashoverlap``) they are written to stderr as ``[flashoverlap] ...``: a compile
that holds up a first call should be seen without any setup. Once it has, its handlers and
levels take them (``logging.getLogger("flashoverlap").setLevel(logging.WARNING)`` drops the
INFO ones).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("flashoverlap")
FORMAT = "[flashoverlap] %(message)s"


class DefaultHandler(logging.Handler):
    """stderr as it stands when a record comes (test runners and notebooks replace it), for records
    no other handler takes: silent once the application has configured its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or any(h is not self for h in logger.handlers):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # as logging's own handlers: a failing stream must not fail the call
            self.handleError(record)


def install() -> None:
    """Put :class:`DefaultHandler` on the ``flashoverlap`` logger (once) and let INFO through,
    unless the application set the logger's level itself."""
    if not any(isinstance(h, DefaultHandler) for h in logger.handlers):
        handler = DefaultHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


install()

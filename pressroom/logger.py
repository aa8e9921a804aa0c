"""pressroom's log lines go to stderr at INFO by default, as vLLM's do: start-up facts (the CPU path,
the KV cache, time to ready), periodic stats and per-request lines are worth seeing without a flag.
PRESSROOM_CONFIGURE_LOGGING=0 leaves logging to the application; PRESSROOM_LOGGING_LEVEL (or vLLM's
VLLM_LOGGING_LEVEL) sets the level."""
from __future__ import annotations

import logging
import os

# Each line starts with its time as vLLM's do (month-day, local time); then level, logger and message, so that
# `grep "INFO pressroom:"` finds the same lines as before the time was added.
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
_HANDLER = "pressroom-default"


def printable(text: str) -> str:
    """`text` safe to put in a log line. Request-supplied strings (session and request ids, model names, paths)
    may hold newlines that forge whole log lines, or terminal escapes and bidi controls that hide them; every
    character that is not printable (and the backslash, so an escape cannot be faked) is written as its Python
    escape (a newline becomes a backslash and an n)."""
    if text.isprintable() and "\\" not in text:
        return text  # the common case: nothing to escape, no copy
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii") for c in text)


def configure_logging(level: str | int | None = None) -> None:
    if os.environ.get("PRESSROOM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("pressroom")
    if not any(h.name == _HANDLER for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.name = _HANDLER
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler the application adds would print each line twice
    logger.setLevel(level or default_level())


def default_level() -> str:
    """Without a --log-level: PRESSROOM_LOGGING_LEVEL, else vLLM's VLLM_LOGGING_LEVEL, else INFO."""
    return (os.environ.get("PRESSROOM_LOGGING_LEVEL") or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper()

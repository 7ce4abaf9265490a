"""The one line a member reports when it leaves a generation after a failure (the reason
``tidal status`` shows in its events and generations).

Most errors read well as ``Type: first line``. gloo's do not: they quote its C++ source
location, and a failed all-reduce's future adds pybind's "Unable to cast ... to Tensor"
around text ending in "GLHF! 🏖️". ``failure_reason`` says what happened in plain words and
keeps gloo's own words, without the source path and the chatter:

    RuntimeError: Unable to cast [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/
    pair.cc:553] Connection closed by peer [127.0.0.1]:32903. This is typically caused by a
    remote worker crashing. Check the logs of the remote worker before ... GLHF! 🏖️ to Tensor

becomes ``RuntimeError: the connection to a peer was lost (gloo: Connection closed by peer
127.0.0.1:32903)``. The worker's log keeps the whole text.
"""

from __future__ import annotations

import re

#: The most a reason carries (the coordinator stores and shows it).
MAX_CHARS = 300

_GLOO = re.compile(r"\[[^\]\n]*gloo[^\]\n]*\.(?:cc|cpp|h):\d+\]\s*")
_ADDRESS = re.compile(r"\[([^\]\s]+)\]:(\d+)")
_MEANINGS = (  # (words in gloo's text, lower case; what happened), first match wins
    (("timed out", "timeout"), "a peer did not answer in time"),
    (
        ("closed", "reset", "read error", "write error", "broken pipe", "refused"),
        "the connection to a peer was lost",
    ),
)


def failure_reason(exc: BaseException) -> str:
    """``exc`` in one line of at most ``MAX_CHARS`` (module doc)."""
    text = str(exc).strip()
    m = _GLOO.search(text)
    if m is None:
        lines = text.splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:MAX_CHARS]
    core = re.split(r"\.\s|\.$|\n", text[m.end() :], maxsplit=1)[0].strip()
    core = _ADDRESS.sub(r"\1:\2", core)
    low = core.lower()
    what = next(
        (meaning for words, meaning in _MEANINGS if any(w in low for w in words)),
        "a collective failed",
    )
    return f"{type(exc).__name__}: {what} (gloo: {core})"[:MAX_CHARS]

"""Whether a process runs: the one answer every part of Tidal that checks a pid uses."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: object) -> bool:
    """True while ``pid`` (a positive int) runs. A process of another user counts as running
    (``kill`` is refused, not failed); a zombie, exited but not yet reaped, does not."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone since, or a system without /proc (then ``kill`` has answered)
        return not Path("/proc/self/stat").exists()
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

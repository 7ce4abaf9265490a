"""Run a small script as N real processes of one gloo group on 127.0.0.1 (tests only).

Each process gets ``RANK PORT`` as its arguments (rank 0 hosts the store on a free port)
and prints one JSON object; ``run_ranks`` returns them in rank order, and kills whatever is
left if one hangs or fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str, n: int, *, timeout: float = 100, args: tuple[str, ...] = ()
) -> list[dict]:
    """``args`` follow ``RANK PORT`` on each process's command line (e.g. a device)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(port), *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    try:
        return [json.loads(p.communicate(timeout=timeout)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()

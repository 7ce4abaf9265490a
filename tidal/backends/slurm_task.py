"""A worker's first moment on its Slurm node: ``python -m tidal.backends.slurm_task ARGV``.

``srun`` (``tidal.backends.slurm``) runs this on the node Slurm or Tidal chose; it sets what
only the node itself can know, then replaces itself (``exec``) with the worker's interpreter
running ``ARGV`` (the script and its arguments), so the worker keeps this process's pid and
gets Slurm's signals (``scancel --signal``) itself.

- Gloo and NCCL bind the address this node's route to the coordinator leaves from
  (``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` name its interface), as on a joined
  host (``backends.addresses``); a variable the environment sets already wins.
- With several GPUs visible to the step (a step shares its node's GPUs, ``--overlap``), the
  worker takes one, by its slot on the node (``TIDAL_SLURM_SLOT``, given by the backend):
  ``slurm_rules.gpu_entry``.
"""

from __future__ import annotations

import os
import sys
from urllib.parse import urlsplit

from tidal.backends.addresses import route_source, socket_env
from tidal.backends.slurm_rules import gpu_entry
from tidal.protocol import ENV_URL

ENV_SLOT = "TIDAL_SLURM_SLOT"  # the worker's slot on its node (``slurm_rules.choose_node``)


def node_env(env: dict[str, str]) -> dict[str, str]:
    """The variables this node adds to the worker's environment ``env``."""
    added: dict[str, str] = {}
    url = urlsplit(env.get(ENV_URL, ""))
    if url.hostname:
        try:
            address = route_source(url.hostname, url.port or 80)
        except OSError:
            address = None  # no route: the worker's own call fails and says so
        if address is not None:
            added.update(socket_env(address, env))
    slot = env.get(ENV_SLOT)
    if slot is not None and slot.isdigit():
        entry = gpu_entry(env.get("CUDA_VISIBLE_DEVICES"), int(slot))
        if entry is not None:
            added["CUDA_VISIBLE_DEVICES"] = entry
    return added


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m tidal.backends.slurm_task SCRIPT [ARGS...]")
    env = dict(os.environ)
    env.update(node_env(env))
    os.execve(sys.executable, [sys.executable, *argv], env)


if __name__ == "__main__":
    main(sys.argv[1:])

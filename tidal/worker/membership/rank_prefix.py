"""One ``[rankN]:`` prefix on a worker's uncaught traceback, not one per generation.

``torch.distributed.init_process_group`` wraps ``sys.excepthook`` in a function
(``_distributed_excepthook``) that prefixes every line of a traceback with ``[rankN]:``,
around whatever hook is in place. torchrun's processes form one group in their life; a
Tidal worker forms one per generation (and a one-member group to warm DDP up), so the
prefixes stacked: ``[rank0]: [rank1]: [rank0]: RuntimeError: ...`` in the worker's log and
in the line ``tidal run`` prints for a failed job, the older ranks wrong.

``unwrapped`` peels torch's wrappers off a hook; the group forming (``group.form_group``)
puts the peeled hook back before each ``init_process_group``, so the traceback carries the
current generation's rank alone. A hook the script installed is kept: only torch's
wrappers (found by name and by their ``old_hook`` cell) are peeled, from the outside in,
down to the first hook that is not one (so a hook the script wraps around torch's after
a group formed keeps that group's prefix under the current one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_TORCH_WRAPPER = "_distributed_excepthook"


def unwrapped(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` without torch's rank-prefix wrappers around it (module doc)."""
    seen = 0
    while getattr(hook, "__name__", "") == _TORCH_WRAPPER and seen < 1000:
        code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
        if code is None or not cells:
            break
        inner = dict(zip(code.co_freevars, cells, strict=False)).get("old_hook")
        try:
            inner_hook = inner.cell_contents if inner is not None else None
        except ValueError:  # an empty cell
            break
        if not callable(inner_hook):
            break
        hook, seen = inner_hook, seen + 1
    return hook


def reset() -> None:
    """Peel torch's rank prefixes off ``sys.excepthook`` (before a new group's init)."""
    sys.excepthook = unwrapped(sys.excepthook)

"""``python -m tidal``: the ``tidal`` command."""

from tidal.cli import main

raise SystemExit(main())

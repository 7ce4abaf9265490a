"""The chaos campaign (issue 15): real jobs, seeded random faults, and checks after each
trial. ``python -m bench.chaos --help``; see ``__main__``, ``kinds`` and ``trial``."""

"""`python -m cs336_systems.baseline` (console script `cs336-baseline`): save a run as the committed per-GPU baseline.

The implementation is `cs336_systems.reporting.baseline`.
"""

from cs336_systems.reporting.baseline import main

if __name__ == "__main__":
    raise SystemExit(main())

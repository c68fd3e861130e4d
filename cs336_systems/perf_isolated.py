"""`python -m cs336_systems.perf_isolated` (console script `cs336-perf-isolated`): each selected perf case in a
fresh process, the runs merged into one saved run.

The implementation is `cs336_systems.reporting.isolated`.
"""

from cs336_systems.reporting.isolated import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m cs336_systems.gates` (console script `cs336-gates`): check a saved run against the ratio gates of benchmarks.json.

The implementation is `cs336_systems.reporting.gates`.
"""

from cs336_systems.reporting.gates import main

if __name__ == "__main__":
    raise SystemExit(main())

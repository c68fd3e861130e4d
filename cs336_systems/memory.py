"""`python -m cs336_systems.memory` (console script `cs336-memory`): CUDA memory snapshots of the measured steps, as text.

The implementation is `cs336_systems.tools.memory`.
"""

from cs336_systems.tools.memory import main

if __name__ == "__main__":
    raise SystemExit(main())

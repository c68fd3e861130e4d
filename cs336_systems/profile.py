"""`python -m cs336_systems.profile` (console script `cs336-profile`): profile one LM case, kernel summaries per phase.

The implementation is `cs336_systems.tools.profile`.
"""

from cs336_systems.tools.profile import main

if __name__ == "__main__":
    raise SystemExit(main())

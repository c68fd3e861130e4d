"""`python -m cs336_systems.accounting` (console script `cs336-accounting`): analytic memory / communication answers.

The implementation is `cs336_systems.tools.accounting`.
"""

from cs336_systems.tools.accounting import main

if __name__ == "__main__":
    raise SystemExit(main())

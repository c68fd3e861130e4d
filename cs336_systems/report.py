"""`python -m cs336_systems.report` (console script `cs336-report`): saved runs -> Markdown report, plots, comparisons, the README block.

The implementation is `cs336_systems.reporting.render`.
"""

from cs336_systems.reporting.render import main

if __name__ == "__main__":
    raise SystemExit(main())

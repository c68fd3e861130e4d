"""`python -m cs336_systems.flash_autotune` (console script `cs336-flash-autotune`): tune flash-triton's tile configurations for your shapes.

The implementation is `cs336_systems.attention.kernels.flash_autotune`.
"""

from cs336_systems.attention.kernels.flash_autotune import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Test helpers shared by the FSDP tests (test_fsdp, test_checkpointing)."""

import time

from cs336_systems.parallel import FSDP


def gathered_alive(fsdp: FSDP) -> int:
    """Gathered buffers still allocated; gloo's worker thread may drop its reference just after wait(),
    so poll for up to a second before counting."""
    for _ in range(100):
        if fsdp.gathered_storages_alive() == 0:
            return 0
        time.sleep(0.01)
    return fsdp.gathered_storages_alive()

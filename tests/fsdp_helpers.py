"""Test helpers shared by the FSDP tests (test_fsdp, test_checkpointing)."""

import gc
import time

from cs336_systems.parallel import FSDP


def gathered_alive(fsdp: FSDP, timeout_s: float = 10.0) -> int:
    """Gathered buffers still allocated.

    gloo's worker thread keeps a finished collective (with its output buffer) in its slot until its loop moves
    on, which can be just after ``wait()`` returns: poll (gc included) for up to ``timeout_s`` before counting.
    A buffer the graph really keeps never expires, so the count stays non-zero and the caller's check fails.
    """
    deadline = time.monotonic() + timeout_s
    while fsdp.gathered_storages_alive() != 0 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return fsdp.gathered_storages_alive()

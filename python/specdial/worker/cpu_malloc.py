"""glibc malloc settings for inference on the CPU: freed blocks stay with the process for reuse.

PyTorch's CPU tensors come straight from ``malloc``. glibc serves a block above its mmap
threshold (128 KiB at start, raised on the fly toward 32 MiB as such blocks are freed) with a
fresh ``mmap`` and unmaps it on ``free``, so every large temporary of a forward (gathered K/V,
the GQA repeat, logits) pays page faults on its first touch. Whether a given size takes that path
depends on what the process allocated and freed before, so two engines running the same batch
in one process differed by up to 2.4x: on the 2-core development VM, in one benchmark process, a
steps-1 decode iteration at batch 16 took 18 ms in one engine and 22-43 ms in another, the whole
difference in page faults (``repeat_interleave`` 69 vs 237 us per call); with the thresholds
fixed both took 18-20 ms (BENCHMARKS.md section 12). Fixing ``M_MMAP_THRESHOLD`` at its maximum
(which also stops the on-the-fly adjustment) and ``M_TRIM_THRESHOLD`` makes the allocator
deterministic; the price is that the process keeps what it freed (its peak use) instead of
returning it to the system. PyTorch's CPU performance guide gets the same effect by preloading
jemalloc or tcmalloc; this needs nothing installed.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["keep_freed_memory"]

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX), bytes.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory at the top of the heap kept rather than returned to the system, bytes.
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docs) once per process.

    Returns True when they are set (now or by an earlier call), False where the C library is not
    glibc or refuses them (nothing changes then). Never raises."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    except (OSError, AttributeError):
        return False
    _applied = ok
    if ok:
        logger.info("CPU: glibc malloc keeps freed blocks for reuse (mmap threshold %d MiB, "
                    "trim threshold %d MiB)", MMAP_THRESHOLD_BYTES >> 20,
                    TRIM_THRESHOLD_BYTES >> 20)
    return ok

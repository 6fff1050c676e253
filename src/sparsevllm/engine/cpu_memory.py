"""glibc's allocator set up for a step loop on the CPU.

torch's CPU tensors come from malloc. glibc serves a request above its mmap threshold
(128 KiB at first, raised as such blocks are freed) with a fresh mapping and unmaps it
on free, and gives the top of its heap back to the OS once more than a trim threshold is
free there. A step allocates and frees the same activations every time (a decode step's
logits alone are 3 MB for a batch of 16 on the default model), so each step faulted its
memory in again, page by page: about 190,000 page faults in a 16 x (256 + 128)-token
benchmark run, and 5-9% of its prefill time. With both thresholds fixed, the heap keeps
freed blocks for the next step: about 65 faults in the same run.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit machines: blocks up to this size
# come from the heap and are reused.
MMAP_THRESHOLD = 32 << 20
# How much free memory the heap's top may keep: a step's activations, reused next step.
TRIM_THRESHOLD = 512 << 20


def keep_step_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module docstring); False
    where the C library is not glibc or refuses."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; a fixed value also stops glibc's own adjusting.
    mmap_set = int(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) == 1
    trim_set = int(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) == 1
    done = mmap_set and trim_set
    if not done:
        logger.warning("glibc refused the allocator thresholds: steps may fault their memory in")
    return done

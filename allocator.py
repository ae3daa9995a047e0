"""Keeps freed memory in the process, so that XLA:CPU does not page-fault through every step.

Import this module first, before anything starts a thread. XLA:CPU allocates an executable's
scratch memory on every call (~86 MB for the CNN's train step at batch 128) and frees it after.
glibc's malloc serves a block that large with a fresh `mmap` and returns it with `munmap`, so
each step faulted in ~21,000 zeroed pages again: a quarter of the step's time on the 2-core
machine. One malloc arena for all threads, no `mmap` and no trimming keep that memory mapped
and reused. Python's own allocations are unaffected. Does nothing where libc is not glibc.
"""

import ctypes
import sys

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to reuse freed memory; returns whether it could."""
  if not sys.platform.startswith('linux'):
    return False
  try:
    libc = ctypes.CDLL('libc.so.6')
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  # glibc only.
  except (OSError, AttributeError):
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


KEPT = keep_freed_memory()

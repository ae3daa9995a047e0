"""core.runtime's malloc setting for XLA:CPU: freed blocks up to MMAP_THRESHOLD stay mapped
for reuse, larger ones go back to the system (kept, they fragmented the one arena)."""

import subprocess
import sys
import textwrap

import pytest

from core import runtime


def _resident_mb_after(block_mb: int) -> tuple[float, float]:
  """In a fresh process with the malloc setting: the resident MB before a `block_mb` block is
  allocated (and written), and after it is freed."""
  script = textwrap.dedent(f'''
      import ctypes, resource
      from core import runtime
      assert runtime.keep_freed_memory()
      libc = ctypes.CDLL('libc.so.6')
      libc.malloc.restype = ctypes.c_void_p
      def resident():
        with open('/proc/self/statm') as file:
          return int(file.read().split()[1]) * resource.getpagesize() / 2**20
      before = resident()
      block = libc.malloc({block_mb} << 20)
      ctypes.memset(block, 1, {block_mb} << 20)
      libc.free(ctypes.c_void_p(block))
      print(before, resident())
      ''')
  output = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          check=True).stdout.split()
  return float(output[0]), float(output[1])


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc on Linux only')
def test_blocks_under_the_threshold_stay_mapped_and_larger_ones_go_back():
  small, large = (runtime.MMAP_THRESHOLD >> 20) // 2, (runtime.MMAP_THRESHOLD >> 20) * 2
  before, after = _resident_mb_after(small)
  assert after - before > 0.9 * small  # Kept for the next step's scratch memory.
  before, after = _resident_mb_after(large)
  assert after - before < 0.1 * large  # Unmapped when freed.

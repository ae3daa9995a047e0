"""core.runtime's malloc setting for XLA:CPU: freed blocks up to MMAP_THRESHOLD stay mapped
for reuse, larger ones go back to the system (kept, they fragmented the one arena), and the
freed memory kept goes back when asked (after compiling); JAX's compilation cache, on by
default outside any workdir."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from core import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROCESS = '''
    import ctypes, resource
    from core import runtime
    assert runtime.keep_freed_memory()
    libc = ctypes.CDLL('libc.so.6')
    libc.malloc.restype = ctypes.c_void_p
    def allocate(size):  # Written, so resident.
      block = libc.malloc(size)
      ctypes.memset(block, 1, size)
      return block
    def resident():
      with open('/proc/self/statm') as file:
        return int(file.read().split()[1]) * resource.getpagesize() / 2**20
    '''


def _printed_numbers(script: str) -> list[float]:
  """What a fresh process with the malloc setting prints running `script` after `_PROCESS`."""
  output = subprocess.run([sys.executable, '-c', textwrap.dedent(_PROCESS) + script],
                          capture_output=True, text=True, check=True).stdout
  return [float(number) for number in output.split()]


def _resident_mb_after(block_mb: int) -> tuple[float, float]:
  """The resident MB before a `block_mb` block is allocated (and written), and after it is
  freed."""
  return tuple(_printed_numbers(textwrap.dedent(f'''
      before = resident()
      libc.free(ctypes.c_void_p(allocate({block_mb} << 20)))
      print(before, resident())
      ''')))


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc on Linux only')
def test_blocks_under_the_threshold_stay_mapped_and_larger_ones_go_back():
  small, large = (runtime.MMAP_THRESHOLD >> 20) // 2, (runtime.MMAP_THRESHOLD >> 20) * 2
  before, after = _resident_mb_after(small)
  assert after - before > 0.9 * small  # Kept for the next step's scratch memory.
  before, after = _resident_mb_after(large)
  assert after - before < 0.1 * large  # Unmapped when freed.


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc on Linux only')
def test_the_freed_memory_kept_among_live_blocks_goes_back_when_released():
  # A compiler's leftovers: 1 MB blocks, every other one freed, so that no freed block is at the
  # heap's end and no two freed ones are adjacent beyond a block.
  kept, released = _printed_numbers(textwrap.dedent('''
      blocks = [allocate(1 << 20) for _ in range(256)]
      for block in blocks[::2]:
        libc.free(ctypes.c_void_p(block))
      before = resident()
      assert runtime.release_freed_memory()
      print(before, resident())
      '''))
  assert kept - released > 0.8 * 128  # The 128 freed MB, unmapped; the live 128 MB stay.


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc on Linux only')
def test_the_compilers_memory_is_released_before_a_large_program_only():
  # Compiled, not run: the decision reads the program's scratch memory alone.
  large = jax.jit(lambda a, b: jnp.sort((a @ b).reshape(-1))[:8]).lower(  # 256 MB a product.
      jax.ShapeDtypeStruct((4096, 64), jnp.float32),
      jax.ShapeDtypeStruct((64, 16384), jnp.float32)).compile()
  small = jax.jit(lambda a: a * 2).lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
  assert large.memory_analysis().temp_size_in_bytes > runtime.MMAP_THRESHOLD
  assert runtime.release_compiler_memory(large)
  assert not runtime.release_compiler_memory(small)


_COMPILE_ONE = '''
    import sys
    from core import runtime
    runtime.use_compilation_cache(sys.argv[1] if len(sys.argv) > 1 else runtime.default_compilation_cache())
    import jax
    jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready()
    '''


def _compile_one(env: dict, *args: str) -> None:
  """Compiles a program in a fresh process with `env` (only PATH beside it), main.py's cache
  setting given `args` (its --compilation_cache) or left to its default."""
  subprocess.run([sys.executable, '-c', textwrap.dedent(_COMPILE_ONE), *args], check=True,
                 env={'PATH': os.environ.get('PATH', ''), 'PYTHONPATH': ROOT, 'JAX_PLATFORMS': 'cpu',
                      'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0', **env}, cwd=ROOT)


def test_compiled_programs_are_kept_in_the_users_cache_directory_by_default(tmp_path):
  _compile_one({'XDG_CACHE_HOME': str(tmp_path)})
  assert list((tmp_path / 'flax_nnx_app' / 'jax').iterdir())  # The compiled program's entry.


def test_jax_compilation_cache_dir_names_the_default(tmp_path, monkeypatch):
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', str(tmp_path / 'mine'))
  assert runtime.default_compilation_cache() == str(tmp_path / 'mine')
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  assert runtime.default_compilation_cache() == str(tmp_path / 'flax_nnx_app' / 'jax')


def test_an_empty_cache_directory_turns_the_cache_off(tmp_path):
  # Where JAX would otherwise cache (its own variable), nothing is written.
  _compile_one({'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'cache')}, '')
  assert not (tmp_path / 'cache').exists() or not list((tmp_path / 'cache').iterdir())

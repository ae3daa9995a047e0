"""Process start-up shared by main.py and sweep.py: import order, flag parsing, malloc tuning.

Import this module before TensorFlow: TensorFlow >= 2.20 loads its bundled LLVM with
RTLD_GLOBAL, so a later load of triton's own LLVM (torchvision pulls triton in through torch)
crashes the process with a segfault (tensorflow/tensorflow#124205). Loaded the other way round,
both work, so triton, when installed, is imported here first.
"""

import ctypes
import importlib.metadata
import importlib.util
import os
import re
import sys

from absl import flags

try:
  import triton  # pylint: disable=unused-import
except ImportError:  # No torch stack installed (or not on Linux): nothing to order.
  pass

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(..., flags_parser=parse_flags)`), with one-line errors.

  A missing or broken config file and an unknown or mistyped `--config.<key>` end the process
  with one line naming the file or key, instead of a traceback from inside ml_collections.
  """
  config_file = _config_argument(argv).split(':')[0]  # 'file.py:arg' passes arg to get_config().
  if config_file and not os.path.isfile(config_file):  # Before ml_collections logs a traceback.
    sys.exit(f'Config error: cannot read the config file {config_file!r} (no such file): pass '
             '--config=PATH of a Python file with get_config(), such as configs/default.py.')
  try:
    rest = flags.FLAGS(argv)
    flags.FLAGS['config'].value  # pylint: disable=pointless-statement  (loads the file now)
    return rest
  except flags.Error as error:
    sys.exit(f'Flag error: {str(error).splitlines()[0]} (see --helpfull).')
  except OSError as error:  # ml_collections' "Failed loading config file ...".
    reason = str(error).splitlines()[-1].strip()
    sys.exit(f'Config error: cannot read the config file {config_file!r} ({reason}): pass '
             '--config=PATH of a Python file with get_config(), such as configs/default.py.')
  except SyntaxError as error:
    sys.exit(f'Config error: the config file {error.filename} has a syntax error at line '
             f'{error.lineno}: {error.msg}.')
  except AttributeError as error:
    if isinstance(error.args[0], KeyError):  # An override of a key the config does not have.
      key, *hint = str(error.args[0].args[0]).split('\n')
      key = key.strip("'")
      override = next((arg.split('=')[0] for arg in argv if re.match(
          rf'--config\.(.+\.)?{re.escape(key)}(=|$)', arg)), f'--config.{key}')
      sys.exit(f'Config error: {override} is not a key of the config'
               f'{" (" + hint[0].strip() + ")" if hint else ""}; the keys are listed in the '
               'config file and by --config=... --helpfull.')
    if 'get_config' in str(error):
      sys.exit(f'Config error: the config file {config_file!r} has no get_config() function '
               'returning an ml_collections.ConfigDict.')
    raise


def _config_argument(argv: list[str]) -> str:
  """The path given by --config=PATH (or '--config PATH') in `argv`."""
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return ''


def jax_will_run_on_cpu() -> bool:
  """Whether JAX's default backend will be XLA:CPU, judged without starting JAX.

  Asking JAX (`jax.default_backend()`) starts its runtime and threads, too late for
  `tune_malloc_for_cpu`. JAX runs on the CPU when $JAX_PLATFORMS names cpu first, or when no
  accelerator plugin (CUDA, ROCm, TPU) is installed.
  """
  if platforms := os.environ.get('JAX_PLATFORMS'):
    return platforms.split(',')[0].strip().lower() == 'cpu'
  return not (importlib.metadata.entry_points(group='jax_plugins')
              or importlib.util.find_spec('jax_plugins')
              or importlib.util.find_spec('libtpu'))


def tune_malloc_for_cpu() -> bool:
  """`keep_freed_memory()` when JAX will run on the CPU; returns whether malloc was tuned.

  Call it first thing in the process, before TensorFlow or JAX start threads (each thread that
  allocated before keeps its own arena, and the setting then gains little).
  """
  return jax_will_run_on_cpu() and keep_freed_memory()


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to keep and reuse freed memory; returns whether it could.

  XLA:CPU allocates an executable's scratch memory on every call and frees it after. glibc
  serves a block that large with a fresh `mmap` and returns it with `munmap`, so every train
  step faults in thousands of zeroed pages again. One malloc arena for all threads, no `mmap`
  and no trimming keep that memory mapped and reused. Python's own allocations are unaffected.
  Measured on XLA:CPU only (docs/performance.md), hence `tune_malloc_for_cpu`. Does nothing
  where libc is not glibc.
  """
  if not sys.platform.startswith('linux'):
    return False
  try:
    libc = ctypes.CDLL('libc.so.6')
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  # glibc only.
  except (OSError, AttributeError):
    return False
  return all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))

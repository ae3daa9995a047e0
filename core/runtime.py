"""The process: start-up order and tuning, quiet logs, and the signals that stop a run.

Import this module first, before TensorFlow: TensorFlow >= 2.20 loads its bundled LLVM with
RTLD_GLOBAL, so a later load of triton's own LLVM (torchvision pulls triton in through torch)
crashes the process with a segfault (tensorflow/tensorflow#124205). Loaded the other way round,
both work, so triton, when installed, is imported here first.

`start` tunes malloc for XLA:CPU and quiets the libraries' start-up notices;
`release_compiler_memory` returns what XLA's compiler freed before a large program runs;
`use_compilation_cache` keeps compiled programs on disk between runs;
`StopSignals` turns SIGTERM, SIGINT and SIGUSR1 (SLURM's warning before preemption or the time
limit) into a request to save a checkpoint and stop, agreed by every process of a
multi-process run through JAX's preemption sync (Orbax's `reached_preemption`).
"""

import ctypes
import importlib.metadata
import importlib.util
import logging as python_logging
import os
import signal
import sys

try:
  import triton  # pylint: disable=unused-import
except ImportError:  # No torch stack installed (or not on Linux): nothing to order.
  pass

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Above the MNIST CNN's scratch block a train step, below a 224-px backbone's largest blocks.
MMAP_THRESHOLD = 128 << 20
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Libraries whose INFO lines, through absl's logging, are shown: clu's parameter overview.
_SHOWN_LIBRARIES = (f'{os.sep}clu{os.sep}',)
_ORBAX = f'{os.sep}orbax{os.sep}'  # In the path of Orbax's source files.
_PACKAGE_FOLDERS = ('site-packages', 'dist-packages')


def start(verbose: bool = False) -> bool:
  """Sets the process up before TensorFlow and JAX start; returns whether malloc was tuned.

  Unless `verbose`, TensorFlow's and XLA's C++ start-up notices (oneDNN, CPU features, TPU
  probing) and TFDS's progress bars are hidden: only the app's own lines and real warnings.
  No Python warning is filtered here: Python's defaults already keep the libraries'
  DeprecationWarnings out of the console (they show only for __main__), and pytest shows them
  in the test run's summary, where the pinned libraries' coming breakages can be fixed.
  """
  if not verbose:
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # Its notice; XLA runs the model.
  return tune_malloc_for_cpu()


def quiet_libraries(verbose: bool = False) -> None:
  """Configures the libraries' logging, once at start-up: Orbax's reports of failures that reach
  the app as exceptions (reported there once, in one line) are dropped, and, unless `verbose`,
  the libraries' own Python INFO lines."""
  python_logging.getLogger('absl').addFilter(_not_reported_by_the_app)  # Orbax logs with absl.
  python_logging.getLogger('asyncio').addFilter(_not_reported_by_the_app)
  if verbose:
    return
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (after start)
  from absl import logging  # pylint: disable=g-import-not-at-top
  tfds.disable_progress_bar()
  logging.get_absl_handler().addFilter(_app_or_warning)
  python_logging.getLogger('tensorflow').setLevel(python_logging.WARNING)


def _not_reported_by_the_app(record: python_logging.LogRecord) -> bool:
  """A logging filter that drops what Orbax reports of a failure the app reports itself.

  Orbax logs the traceback of each of its threads that fails, then raises the same error to
  the caller, which the app reports once. A failed read or write also leaves asyncio tasks of
  Orbax whose exception nobody retrieves: asyncio logs each with its traceback when it is
  collected, at any later moment. And Orbax warns at each check of the preemption sync point,
  3-4 times per process, where the run's last line says where it saved and why it stopped.
  """
  if _ORBAX in record.pathname:
    return not (record.exc_info or 'Reached preemption sync point' in record.getMessage())
  return not (record.name == 'asyncio' and record.exc_info
              and raised_in_orbax(record.exc_info[2]))


def raised_in_orbax(trace) -> bool:
  """Whether a traceback passes through Orbax's code."""
  while trace is not None:
    if _ORBAX in trace.tb_frame.f_code.co_filename:
      return True
    trace = trace.tb_next
  return False


def _app_or_warning(record: python_logging.LogRecord) -> bool:
  """A logging filter: the app's own lines, and the libraries' warnings and errors."""
  return (record.levelno >= python_logging.WARNING or not _in_library(record.pathname)
          or any(name in record.pathname for name in _SHOWN_LIBRARIES))


def _in_library(path: str) -> bool:
  """Whether `path` is an installed package's file rather than the app's or the user's own
  (a config file or plug-in anywhere): in site-packages, or in dist-packages, where Debian's
  and Ubuntu's system Python installs them (Colab, Cloud TPU VMs)."""
  return any(f'{os.sep}{folder}{os.sep}' in path for folder in _PACKAGE_FOLDERS)


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
  step faults in thousands of zeroed pages again. One malloc arena for all threads, no
  trimming, and blocks up to `MMAP_THRESHOLD` from that arena keep that memory mapped and
  reused. Larger blocks still get their own `mmap`: kept in the arena too, the blocks of a
  224-px backbone's step fragmented it until the process held several times the step's memory.
  So such a step faults in its scratch memory at every call (docs/backbone_speed.md, "page
  faults a step"). Python's own allocations are unaffected. Measured on XLA:CPU only
  (docs/performance.md), hence `tune_malloc_for_cpu`. Does nothing where libc is not glibc.
  """
  libc = _glibc()
  return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1)))


def release_freed_memory() -> bool:
  """Returns the free pages of malloc's heap to the system (glibc's `malloc_trim`); returns
  whether it could. Does nothing where libc is not glibc."""
  libc = _glibc()
  return libc is not None and libc.malloc_trim(0) in (0, 1)


def release_compiler_memory(compiled) -> bool:
  """`release_freed_memory()` before the first call of `compiled` (a `jax.stages.Compiled`) if
  that program's scratch memory exceeds `MMAP_THRESHOLD`; returns whether it released.

  XLA's compiler frees hundreds of MB when it is done, which `keep_freed_memory` keeps in the
  heap, in fragments among live blocks: a large step's buffers (tens of MB each at 224 px) do
  not fit in them and take fresh memory beside them, so the compiler's leftovers add to the
  step's peak (ResNet-50, ViT-S/16 and EfficientNet-B0 at batch 32: docs/backbone_speed.md).
  Trimmed, those pages are unmapped and the step maps only what it needs; memory freed by later
  steps stays kept, as `keep_freed_memory` intends. A small step (MNIST's CNN: 92 MB) fits
  among the fragments and gains nothing, and faulting the trimmed pages in again costs time:
  the test suite's small runs, many to a process, were slower with every compilation released.
  """
  analysis = compiled.memory_analysis()
  if analysis is None or analysis.temp_size_in_bytes <= MMAP_THRESHOLD:
    return False
  return release_freed_memory()


def default_compilation_cache() -> str:
  """Where compiled programs are kept between runs: $JAX_COMPILATION_CACHE_DIR if set, else
  the user's cache directory ($XDG_CACHE_HOME, by default ~/.cache) under this app's name.
  Never in a workdir: checkpoints and exports stay what the run wrote, and one cache serves
  every run, resume and sweep trial of the same programs."""
  return os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
      os.environ.get('XDG_CACHE_HOME') or os.path.expanduser(os.path.join('~', '.cache')),
      'flax_nnx_app', 'jax')


def use_compilation_cache(directory: str) -> None:
  """Turns JAX's persistent compilation cache on in `directory`, or off if it is empty.

  XLA's compilation of a program (a backbone's train step: tens of seconds on a TPU, ~10 s on
  a CPU) is then done once per machine: a rerun, a resume or a sweep's next trial reads the
  executable from disk, keyed by the program and the compiler's options. JAX's own thresholds
  decide what is kept (programs that took at least a second to compile).
  """
  import jax  # pylint: disable=g-import-not-at-top  (after start)
  if not directory:
    jax.config.update('jax_enable_compilation_cache', False)
    return
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', os.path.expanduser(directory))


def _glibc() -> ctypes.CDLL | None:
  """The process's C library if it is glibc (whose malloc these functions tune), else None."""
  if not sys.platform.startswith('linux'):
    return None
  try:
    libc = ctypes.CDLL('libc.so.6')
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  # glibc only.
  except (OSError, AttributeError):
    return None
  return libc


class Interrupted(Exception):
  """A stop signal ended training after a checkpoint was saved; `signum` is the signal."""

  def __init__(self, signum: int, step: int, directory: str):
    super().__init__(f'Received {signal.Signals(signum).name}: saved a checkpoint at step {step} '
                     f'in {directory} and stopped. Rerun the same command to resume.')
    self.signum, self.step = signum, step


class StopSignals:
  """While active (a `with` block), a stop signal asks the run to save and stop.

  One process: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 are caught here; a second SIGTERM or SIGINT
  stops the process at once. Several processes: JAX's runtime catches SIGTERM on any process
  and its preemption sync lets all agree on the step to stop at; a SIGUSR1 is passed on to JAX
  as a SIGTERM, and SIGINT keeps its default (a save by one process alone would wait forever
  for the others).
  """

  def __init__(self, num_processes: int):
    self._num_processes = num_processes
    self.received: int | None = None  # The stop signal received, if any.
    self._handlers = {}

  def __enter__(self) -> 'StopSignals':
    caught = STOP_SIGNALS if self._num_processes == 1 else (signal.SIGUSR1,)
    self._handlers = {signum: signal.signal(signum, self._on_signal) for signum in caught}
    return self

  def __exit__(self, *exc_info) -> None:
    self._restore()

  def _restore(self) -> None:
    for signum, handler in self._handlers.items():
      signal.signal(signum, handler)
    self._handlers = {}

  def _on_signal(self, signum, frame) -> None:
    del frame
    self.received = signum
    if self._num_processes > 1:  # JAX's preemption notifier listens to SIGTERM.
      os.kill(os.getpid(), signal.SIGTERM)
      return
    python_logging.getLogger('absl').warning(
        'Received %s: saving a checkpoint after the current step, then stopping (send it again '
        'to stop at once).', signal.Signals(signum).name)
    self._restore()
    if signum == signal.SIGUSR1:  # A second SIGUSR1 must not kill the process.
      signal.signal(signal.SIGUSR1, signal.SIG_IGN)

  def reached(self, step: int) -> bool:
    """Whether the run must save at `step` and stop: a signal here, or, with several
    processes, the step all of them agreed on after one received SIGTERM."""
    if self._num_processes == 1:
      return self.received is not None
    from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top  (after start)
    if multihost.reached_preemption(step):
      self.received = self.received or signal.SIGTERM
      return True
    return False

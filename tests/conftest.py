"""Shared fixtures: real MNIST through TFDS, prepared offline when ../shared has the files; one
XLA compilation cache for the session."""

import os
import pathlib
import shutil
import tempfile

import pytest

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

# In-process training in the tests runs as it does in main.py.
runtime.start()
# A child process that crashes (a segfault in a native library) says where, in its stderr.
os.environ.setdefault('PYTHONFAULTHANDLER', '1')
# JAX's persistent compilation cache, one for the session (set before JAX starts, so that the
# xdist workers and every main.py a test starts share it): many tests compile the same programs
# (the default CNN's steps), and a program is keyed by its HLO and XLA's options, so each one
# is compiled once and every test still runs its own. Removed when the session ends.
_COMPILATION_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _COMPILATION_CACHE = os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
      prefix='jax-compilation-cache-')
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'  # Default 1 s: most of ours.

from tests.helpers.optional import SHARED_MNIST  # pylint: disable=g-import-not-at-top


@pytest.fixture(scope='session')
def tfds_data_dir(tmp_path_factory) -> str:
  """A TFDS data dir holding prepared MNIST.

  $TFDS_DATA_DIR if set (as `.ci/run` does); otherwise a temporary dir seeded with the original
  files from ../shared/datasets/mnist (copied, never written in place); otherwise TFDS's default
  dir, where TFDS downloads MNIST. Where none of these can give it (no files, no network), the
  tests that need real MNIST are skipped with the app's own one-line message of what to put
  where, instead of each retrying the download.
  """
  from core import errors  # pylint: disable=g-import-not-at-top
  from data_sources import tfds_source  # pylint: disable=g-import-not-at-top
  data_dir = os.environ.get('TFDS_DATA_DIR')
  if not data_dir and SHARED_MNIST.is_dir():
    data_dir = str(tmp_path_factory.mktemp('tfds'))
    manual_dir = pathlib.Path(data_dir, 'downloads', 'manual')
    manual_dir.mkdir(parents=True)
    for path in SHARED_MNIST.glob('*.gz'):
      shutil.copy(path, manual_dir)
  try:
    builder = tfds_source.prepared_builder('mnist', data_dir)
  except errors.DataError as error:
    pytest.skip(f'real MNIST is not available: {error}')
  return str(builder.data_dir_root)


def pytest_sessionfinish(session):
  del session  # Unused: the process that made the cache removes it (xdist's controller).
  if _COMPILATION_CACHE:
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)

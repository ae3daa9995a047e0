"""Orbax checkpoints of a training run: save, restore the newest that restores, keep the best.

A checkpoint `<workdir>/checkpoints/<step>`, written by Orbax's `CheckpointManager`, holds three
items:
  state: the whole `TrainState` (model with its BatchNorm statistics and dropout RNG state,
    optimizer, EMA, train-metric sums), so a resumed run continues bit-exactly;
  progress: JSON {epoch, step_in_epoch, steps_per_epoch, layout, and the state of the loop's
    hooks} at the save: where the input pipeline continues (every epoch's order is derived from
    config.seed, so the position is enough);
  metrics: JSON, the eval metrics of an epoch-end checkpoint with its SCORE (the run's best
    metric, signed so that higher is better): written by the manager with the save, so that
    another run's init_from finds the best without knowing how this run judged it.
Orbax writes a checkpoint into a temporary directory and renames it once complete, so a process
killed at any moment, even mid-save, leaves nothing that the next start would pick up (the next
start removes the temporary directory). Orbax's preservation policy keeps the newest
`max_to_keep` and the best by SCORE, and deletes the others after each save.

An epoch's checkpoint is saved after its evaluations, with their metrics, and the progress of
every hook, stored once. An evaluation that fails has the epoch's checkpoint saved without
metrics first (training/hooks.py), so that it loses no training.
"""

import errno
import math
import os
import re
import shutil
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts

from core import errors

CHECKPOINT_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt'  # Under CHECKPOINT_DIR: checkpoints that failed to restore.
# In an epoch-end checkpoint's metrics: the run's best metric, signed so that higher is better.
SCORE = 'checkpoint_score'
LAYOUT = 2  # Of the items above; checkpoints of other layouts are refused with one line.
_MAX_LISTED = 6  # Differing keys named in a mismatch error.
# The errnos of a write that the disk or its permissions refused: the user frees space or fixes
# permissions and reruns (`io_failure`).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                            errno.EPERM, errno.EIO})
_CHECKPOINTS_OF_SPACE = 3  # Free space below this many checkpoints' size at start: a warning.


def io_failure(error: BaseException) -> str | None:
  """The OS's reason, such as 'No space left on device', if `error` is a write that the disk
  refused (`STORAGE_ERRNOS`).

  Python's file functions raise `OSError` with an errno. Orbax's TensorStore writes raise
  its own `ValueError`s and TensorFlow's file writers their own errors, which carry the errno
  only in their message (os_error_code='28'); no library offers a type for it, so it is read
  from the message. Other OSErrors are not the disk's: a host name that does not resolve is a
  `socket.gaierror` of errno -2, a missing input file ENOENT.
  """
  while error is not None:
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
      return os.strerror(error.errno)
    if ((code := re.search(r"os_error_code='(\d+)'", str(error)))
        and int(code.group(1)) in STORAGE_ERRNOS):
      return os.strerror(int(code.group(1)))
    if 'No space left on device' in str(error):
      return os.strerror(errno.ENOSPC)
    error = error.__cause__ or error.__context__
  return None


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'model.linear1.kernel.value': shape} for every leaf; PRNG keys count as their key data."""
  def shape(leaf):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape)
  return {name: shape(leaf) for name, leaf in _flat(tree).items()}


def _differences(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
  """Human-readable differences between the leaf shapes of a checkpoint and of the config."""
  def listed(keys):
    keys = sorted(keys)
    return ', '.join(keys[:_MAX_LISTED]) + (f' and {len(keys) - _MAX_LISTED} more'
                                            if len(keys) > _MAX_LISTED else '')
  differences = []
  if missing := wanted.keys() - saved.keys():
    differences.append(f'not in the checkpoint: {listed(missing)}')
  if extra := saved.keys() - wanted.keys():
    differences.append(f'only in the checkpoint: {listed(extra)}')
  if reshaped := [key for key in saved.keys() & wanted.keys() if saved[key] != wanted[key]]:
    differences.append('shapes differ (checkpoint vs config): ' + listed(
        f'{key} {saved[key]} vs {wanted[key]}' for key in reshaped))
  return differences


def _first_line(error: Exception) -> str:
  """'FileNotFoundError: ...' on one line, short: Orbax's messages run to many lines."""
  text = ' '.join(str(error).split())
  return f'{type(error).__name__}: {text[:200]}{"..." if len(text) > 200 else ""}'




# A damaged checkpoint's restore fails inside Orbax on its first unreadable array, and Orbax
# closes its event loop with the other reads still in flight: TensorStore ends them into the
# closed loop ('Event loop is closed') and their coroutines, collected later, raise again
# ('Exception ignored in'), tracebacks after the one-line warning that neither library offers a
# way to wait for or cancel. So the app reads every stored value of the `state` item itself
# first, through TensorStore's public key-value store API, and waits for every read: a
# truncated or missing file fails here, with nothing left pending, and Orbax is asked to
# restore only a checkpoint whose bytes all read.
_READS_IN_FLIGHT = 64  # Bounds the bytes held at once to 64 chunks.


def verify_readable(path: str) -> None:
  """Raises the first error met reading the stored values of the `state` item at `path` (an
  OCDBT key-value store, Orbax's default format), after every read has ended."""
  store = ts.KvStore.open({'driver': 'ocdbt', 'base': f'file://{os.path.abspath(path)}'}).result()
  keys = store.list().result()
  for first in range(0, len(keys), _READS_IN_FLIGHT):
    reads = [store.read(key) for key in keys[first:first + _READS_IN_FLIGHT]]
    failures = []
    for read in reads:  # Each awaited, even after a failure.
      try:
        read.result()
      except Exception as error:  # pylint: disable=broad-except  (TensorStore raises many)
        failures.append(error)
    if failures:
      raise failures[0]


def checkpoint_path(path: str) -> str:
  """The `state` item of what `path` names: a checkpoint step directory of this app, a
  checkpoints directory or a workdir (then its best checkpoint by the SCORE saved with it, else
  its newest). A `ConfigError` if it names none."""
  for candidate in (path, os.path.join(path, CHECKPOINT_DIR)):
    if os.path.isdir(os.path.join(candidate, 'state')):
      return os.path.join(candidate, 'state')
    steps = [int(name) for name in (os.listdir(candidate) if os.path.isdir(candidate) else ())
             if name.isdigit()]
    if steps:
      best = None
      if os.path.basename(os.path.normpath(candidate)) == CHECKPOINT_DIR:
        checkpoints = Checkpoints(os.path.dirname(os.path.normpath(candidate)), reader=True)
        best = checkpoints.best_step()
        checkpoints.close()
      return os.path.join(candidate, str(best if best in steps else max(steps)), 'state')
  raise errors.ConfigError(f'config.init_from={path!r} is not a checkpoint, checkpoints '
                           'directory or workdir of this app: pass one (e.g. runs/mnist).',
                           key='init_from', value=path)


def read_state(path: str) -> dict[str, object]:
  """{'model.conv1.kernel': array, ...} of the `state` item at `path`, on this host, whatever
  devices and processes wrote it."""
  try:
    verify_readable(path)
  except Exception as error:  # pylint: disable=broad-except  (TensorStore raises many)
    raise errors.CheckpointError(
        f'The checkpoint {path} does not read ({_first_line(error)}): pass another one (e.g. '
        'an earlier step).', directory=os.path.dirname(path)) from None
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  tree = checkpointer.restore(path, jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
      checkpointer.metadata(path).item_metadata))
  return {name.removesuffix('.value'): leaf for name, leaf in _flat(tree).items()}


def _flat(tree, is_leaf=None) -> dict[str, object]:
  """{'model.conv1.kernel.value': leaf} of a pytree."""
  def name(path):
    return '.'.join(str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key))))
                    for key in path)
  return {name(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def _state_bytes(state: nnx.Module) -> int:
  """The bytes of `state`'s arrays, about what a checkpoint of it takes on disk."""
  return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(state))
             if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))


class Checkpoints:
  """The checkpoints of one workdir: Orbax's `CheckpointManager` saves, lists, restores and
  deletes them, keeping the newest and the best by its preservation policy."""

  def __init__(self, workdir: str, best_metric: str | None = None, maximize: bool = True,
               max_to_keep: int = 3, *, reader: bool = False):
    """`best_metric` (with `maximize`) picks the epoch-end checkpoint kept as the best. A
    `reader` (eval, predict, export, init_from) creates nothing and leaves temporary
    directories alone: they may be the save in progress of a run training in that workdir."""
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    self._best_metric, self._sign = best_metric, 1 if maximize else -1
    policies = ocp.checkpoint_managers
    # Synchronous saves: the train step donates the state's buffers right after a save returns.
    # The best is the highest SCORE (the later of equals); a checkpoint without metrics (saved
    # by a version of this app that kept them elsewhere) is never deleted.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            create=not reader, enable_async_checkpointing=False,
            cleanup_tmp_directories=not reader, best_fn=self._score, best_mode='max',
            preservation_policy=policies.AnyPreservationPolicy([
                policies.LatestN(max_to_keep),
                policies.BestN(get_metric_fn=self._score, n=1,
                               keep_checkpoints_without_metrics=True)])),
        # Named handlers let a fresh process read the metadata of existing checkpoints.
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'progress': ocp.JsonCheckpointHandler()})

  def _score(self, metrics: dict) -> float:
    """The SCORE of a checkpoint's `metrics`: -inf for one saved without eval metrics. An
    earlier version of this app saved the metrics without it: theirs is `best_metric`'s."""
    if SCORE in metrics:
      return metrics[SCORE]
    if self._best_metric in metrics:
      return self._sign * metrics[self._best_metric]
    return -math.inf

  def _scored(self, metrics: dict[str, float]) -> dict[str, float]:
    """The eval `metrics` to save with a checkpoint: with their SCORE when they hold the
    best metric."""
    if self._best_metric not in metrics:
      return dict(metrics)
    return {**metrics, SCORE: self._sign * metrics[self._best_metric]}

  def close(self) -> None:
    """Waits for Orbax's background work and ends it."""
    self._manager.close()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def best_step(self) -> int | None:
    """The epoch-end checkpoint with the highest SCORE (the later of equals); None when none
    has one."""
    step = self._manager.best_step()
    if step is None or self._score(self._manager.metrics(step) or {}) == -math.inf:
      return None
    return step

  def latest_progress(self) -> dict | None:
    """The progress of the newest checkpoint (JSON only, no arrays read), if any."""
    for step in reversed(self.all_steps()):
      try:
        return self._progress(step)
      except Exception:  # pylint: disable=broad-except  (a damaged one: try the one before)
        continue
    return None

  def warn_if_disk_low(self, state: nnx.Module) -> None:
    size, free = _state_bytes(state), shutil.disk_usage(self.directory).free
    if free < _CHECKPOINTS_OF_SPACE * size:
      logging.warning('Only %.1f MB free in %s, less than %d checkpoints of %.1f MB: a save may '
                      'fail for lack of space.', free / 1e6, self.directory,
                      _CHECKPOINTS_OF_SPACE, size / 1e6)

  def save(self, step: int, state: nnx.Module, progress: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Saves checkpoint `step` of `state` with `progress` and the eval `metrics` (an epoch's,
    by which the best is kept), then Orbax deletes the checkpoints no longer kept. A
    `StorageError` if the disk is full or not writable, the earlier ones intact."""
    start = time.time()
    # A save that fails part-way leaves TensorStore's other writes running after Orbax gave
    # up, each reporting it with a traceback as it ends: a save that cannot fit never starts.
    if shutil.disk_usage(self.directory).free < _state_bytes(state):
      raise self._storage_error(step, os.strerror(errno.ENOSPC))
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(nnx.state(state)),
          progress=ocp.args.JsonSave({**progress, 'layout': LAYOUT})),
          metrics=self._scored(metrics or {}))
    except Exception as error:  # pylint: disable=broad-except  (re-raised unless an OS error)
      if (reason := io_failure(error)) is None:
        raise
      # The run ends with this error: the failed save's temporary directory holds the space.
      if jax.process_index() == 0:
        for partial in ocp.utils.tmp_checkpoints(self.directory):
          shutil.rmtree(partial.get(), ignore_errors=True)
      raise self._storage_error(step, reason) from error
    logging.info('Saved checkpoint at step %d in %.2fs.', step, time.time() - start)

  def _storage_error(self, step: int, reason: str) -> errors.StorageError:
    kept = self.all_steps()
    earlier = (f'The earlier checkpoints (steps {", ".join(map(str, kept))}) are kept' if kept
               else 'No earlier checkpoint was saved')
    return errors.StorageError(
        f'Could not save the checkpoint at step {step} in {self.directory}: {reason}. '
        f'{earlier}; free space (or fix the permissions) and rerun the same command to resume.',
        path=self.directory, reason=reason)

  def _progress(self, step: int) -> dict:
    """The progress saved with checkpoint `step`."""
    return self._manager.restore(step, args=ocp.args.Composite(
        progress=ocp.args.JsonRestore()))['progress']

  def _restore(self, step: int, state: nnx.Module) -> dict:
    """Restores checkpoint `step` into `state` (in place); returns its progress.

    Its structure is checked first: a `CheckpointError` naming the differences if it does not
    fit the config, or if an older version of this app wrote it.
    """
    metadata = self._manager.metadata(step).item_metadata
    if metadata.get('state') is None:
      if any(os.path.isdir(os.path.join(self.directory, str(step), item))
             for item in ('model', 'train')):  # The items of the first layout.
        raise errors.CheckpointError(
            f'The checkpoints in {self.directory} were written by an earlier version of this '
            'app, in a layout it no longer reads: pass a new --workdir (or move this one aside).',
            directory=self.directory, step=step)
      raise FileNotFoundError('the metadata of its state is missing')
    target = nnx.state(state)
    if differences := _differences(_flat_shapes(metadata['state']), _flat_shapes(target)):
      raise errors.CheckpointError(
          f'The state of the checkpoint at step {step} in {self.directory} does not match the '
          f'config ({"; ".join(differences)}). Use the config it was written with (model, '
          'optimizer, EMA, dataset), or a new --workdir.', directory=self.directory, step=step)
    start = time.time()
    verify_readable(os.path.join(self.directory, str(step), 'state'))
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), progress=ocp.args.JsonRestore()))
    nnx.update(state, restored['state'])
    logging.info('Restored checkpoint at step %d from %s in %.2fs.', step, self.directory,
                 time.time() - start)
    return restored['progress']

  def restore_newest(self, state: nnx.Module, *, move_aside: bool) -> tuple[int, dict] | None:
    """Restores the newest checkpoint that restores into `state`: (step, progress), or None
    if there is no checkpoint.

    A checkpoint that fails to restore (a truncated or missing file) is reported with its step
    and the reason, and, when `move_aside`, moved into <checkpoints>/corrupt/ (never deleted),
    so that the next start does not trip over it again. Only when every checkpoint fails does
    this raise, naming them. A checkpoint whose intact state does not fit the config raises at
    once: an older one would not fit either.
    """
    steps = sorted(self.all_steps(), reverse=True)
    for step in steps:
      try:
        return step, self._restore(step, state)
      except errors.CheckpointError:
        raise
      except Exception as error:  # pylint: disable=broad-except  (Orbax/TensorStore raise many)
        reason = _first_line(error)
      if move_aside:
        logging.warning('The checkpoint at step %d does not restore (%s): moved to %s; trying '
                        'the one before it.', step, reason, self._move_aside(step))
      else:
        logging.warning('The checkpoint at step %d in %s does not restore (%s): trying the one '
                        'before it.', step, self.directory, reason)
    if not steps:
      return None
    where = os.path.join(self.directory, CORRUPT_DIR) if move_aside else self.directory
    raise errors.CheckpointError(
        f'None of the {len(steps)} checkpoints in {self.directory} (steps '
        f'{", ".join(map(str, steps))}) restores (see the warnings above; they are in {where}): '
        'pass a new --workdir, or rerun this one to train from scratch.',
        directory=self.directory)

  def restore(self, state: nnx.Module, checkpoint: str = 'latest') -> int:
    """Restores `checkpoint` into `state`, read-only: 'latest' (the newest that restores; a
    damaged one is skipped, not moved, as a training run may be using them), 'best' or a step
    number. Returns its step; a `CheckpointError` if there is no such checkpoint."""
    if checkpoint == 'latest':
      if (newest := self.restore_newest(state, move_aside=False)) is None:
        raise errors.CheckpointError(
            f'No checkpoint in {self.directory}: train first with the same --workdir '
            '(python main.py --config=... --workdir=...).', directory=self.directory)
      return newest[0]
    step = self._chosen_step(checkpoint)
    self._restore(step, state)
    return step

  def _chosen_step(self, checkpoint: str) -> int:
    """The step that --checkpoint=best or --checkpoint=STEP names."""
    steps = self.all_steps()
    if checkpoint == 'best':
      if (step := self.best_step()) is None:
        raise errors.CheckpointError(
            f'No checkpoint in {self.directory} has eval metrics to pick the best by (they are '
            'saved at epoch ends): use --checkpoint=latest or a step number.',
            directory=self.directory)
      return step
    if not checkpoint.isdigit() or int(checkpoint) not in steps:
      raise errors.CheckpointError(
          f'--checkpoint={checkpoint} is not a checkpoint of {self.directory}: use best, '
          f'latest or one of the steps {", ".join(map(str, steps)) or "(none)"}.',
          directory=self.directory, step=checkpoint)
    return int(checkpoint)

  def _move_aside(self, step: int) -> str:
    """Moves checkpoint `step` into <checkpoints>/corrupt/ (as <step>.<n> if taken); its path."""
    corrupt = os.path.join(self.directory, CORRUPT_DIR)
    os.makedirs(corrupt, exist_ok=True)
    target = os.path.join(corrupt, str(step))
    suffix = 0
    while os.path.exists(target):
      suffix += 1
      target = os.path.join(corrupt, f'{step}.{suffix}')
    os.rename(os.path.join(self.directory, str(step)), target)
    self._manager.reload()
    return target

"""Orbax checkpoints of a training run: save, restore the newest that restores, keep the best.

A checkpoint `<workdir>/checkpoints/<step>` holds two items:
  state: the whole `TrainState` (model with its BatchNorm statistics and dropout RNG state,
    optimizer, EMA, train-metric sums), so a resumed run continues bit-exactly;
  progress: JSON {epoch, step_in_epoch, steps_per_epoch, layout, and the state of the loop's
    hooks}: where the input pipeline continues (every epoch's order is derived from config.seed,
    so the position is enough).
Epoch-end checkpoints also carry the eval metrics, by which Orbax keeps the best one
(`best_fn`) besides the newest `max_checkpoints_to_keep`. Orbax writes a checkpoint into a
temporary directory and renames it once complete, so a process killed at any moment, even
mid-save, leaves nothing that the next start would pick up.
"""

import contextlib
import datetime
import errno
import glob
import json
import logging as python_logging
import os
import re
import shutil
import sys
import threading
import time
from typing import NamedTuple

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from core import errors

CHECKPOINT_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt'  # Under CHECKPOINT_DIR: checkpoints that failed to restore.
LAYOUT = 2  # Of the items above; checkpoints of other layouts are refused with one line.
_MAX_LISTED = 6  # Differing keys named in a mismatch error.
_CHECKPOINTS_OF_SPACE = 3  # Free space below this many checkpoints' size at start: a warning.


def io_failure(error: BaseException) -> str | None:
  """The OS's reason, such as 'No space left on device', if `error` is a failed write or read.

  Python's file functions raise `OSError` with an errno. Orbax's TensorStore writes raise
  its own `ValueError`s and TensorFlow's file writers their own errors, which carry the errno
  only in their message (os_error_code='28'); no library offers a type for it, so it is read
  from the message.
  """
  while error is not None:
    if isinstance(error, OSError) and error.errno:
      return os.strerror(error.errno)
    if code := re.search(r"os_error_code='(\d+)'", str(error)):
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


def _orbax_warnings_only(record) -> bool:
  """A logging filter: Orbax logs ~40 INFO lines per save; we log one line per save instead.

  Orbax also logs the traceback of each of its writer threads that fails; the save re-raises
  the same error to its caller, which reports it once. And it warns at every save without
  metrics while it tracks a best: the mid-epoch saves carry none on purpose (the best is an
  epoch-end checkpoint). Its warning of the preemption sync point comes at each of its checks,
  3-4 times per process; the run's last line says where it saved and why it stopped.

  A failed read or write also leaves asyncio tasks of Orbax whose exception nobody retrieves;
  asyncio logs each with its traceback when the task is garbage-collected, at any later moment
  (in one of several runs of a damaged checkpoint's fallback): the restore or save reported the
  same failure once already.
  """
  if record.name == 'asyncio' and record.exc_info and _raised_in_orbax(record.exc_info[2]):
    return False
  if f'{os.sep}orbax{os.sep}' not in record.pathname:
    return True
  message = record.getMessage()
  return record.levelno >= python_logging.WARNING and not any(
      repeated in message for repeated in ('raised an exception', 'did not provide metrics',
                                           'Reached preemption sync point'))


def _raised_in_orbax(trace) -> bool:
  """Whether a traceback passes through Orbax's code."""
  while trace is not None:
    if f'{os.sep}orbax{os.sep}' in trace.tb_frame.f_code.co_filename:
      return True
    trace = trace.tb_next
  return False


@contextlib.contextmanager
def _reports_held():
  """Holds what Orbax's and TensorStore's threads report as they fail inside the block (their
  exceptions that nothing can raise, such as 'Event loop is closed' after a failed read or
  write): dropped if the block fails, since its own error says the same once and the caller
  reports it in one line; printed as usual if it succeeds. TensorStore prints through
  sys.excepthook (PyErr_Print), the others through the unraisable, thread and asyncio hooks."""
  unraisable, thread_failures, uncaught, asyncio_records = [], [], [], []
  report_unraisable, sys.unraisablehook = sys.unraisablehook, unraisable.append
  report_thread, threading.excepthook = threading.excepthook, thread_failures.append
  report_uncaught, sys.excepthook = sys.excepthook, lambda *report: uncaught.append(report)
  asyncio_logger = python_logging.getLogger('asyncio')  # 'Task exception was never retrieved'.
  hold_record = lambda record: asyncio_records.append(record) and False
  asyncio_logger.addFilter(hold_record)
  failed = True
  try:
    yield
    failed = False
  finally:
    sys.unraisablehook, threading.excepthook = report_unraisable, report_thread
    sys.excepthook = report_uncaught
    asyncio_logger.removeFilter(hold_record)
    if failed:
      _drop_closed_loop_reports()
  for report in unraisable:
    report_unraisable(report)
  for report in thread_failures:
    report_thread(report)
  for report in uncaught:
    report_uncaught(*report)
  for record in asyncio_records:
    asyncio_logger.handle(record)


def _drop_closed_loop_reports() -> None:
  """From a failed read or write on, drops the reports of 'RuntimeError: Event loop is closed'
  (any other report still prints): the failed operation's other TensorStore writes can end
  later, at any moment (under load, after main.py printed the failure in one line), each
  calling back into Orbax's event loop, closed by then, and printing the traceback."""
  closed = lambda error: isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
  if getattr(sys.excepthook, 'drops_closed_loops', False):
    return
  report_unraisable, report_thread, report_uncaught = (
      sys.unraisablehook, threading.excepthook, sys.excepthook)

  def uncaught(kind, error, trace):
    if not closed(error):
      report_uncaught(kind, error, trace)

  uncaught.drops_closed_loops = True
  sys.excepthook = uncaught
  sys.unraisablehook = lambda report: closed(report.exc_value) or report_unraisable(report)
  threading.excepthook = lambda report: closed(report.exc_value) or report_thread(report)


def checkpoint_path(path: str) -> str:
  """The `state` item of what `path` names: a checkpoint step directory of this app, a
  checkpoints directory or a workdir (then its newest checkpoint). A `ConfigError` if it names
  none."""
  for candidate in (path, os.path.join(path, CHECKPOINT_DIR)):
    if os.path.isdir(os.path.join(candidate, 'state')):
      return os.path.join(candidate, 'state')
    steps = [int(name) for name in (os.listdir(candidate) if os.path.isdir(candidate) else ())
             if name.isdigit()]
    if steps:
      return os.path.join(candidate, str(max(steps)), 'state')
  raise errors.ConfigError(f'config.init_from={path!r} is not a checkpoint, checkpoints '
                           'directory or workdir of this app: pass one (e.g. runs/mnist).',
                           key='init_from', value=path)


def read_state(path: str) -> dict[str, object]:
  """{'model.conv1.kernel': array, ...} of the `state` item at `path`, on this host, whatever
  devices and processes wrote it."""
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


def init_weights(model: nnx.Module, saved_path: str,
                 exclude: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
  """Loads into `model` the weights (parameters and BatchNorm statistics) of the `state` item
  at `saved_path` whose path and shape match, but those matching a pattern of `exclude`: the
  averaged weights when that run kept an EMA. Returns the names loaded and the others (left as
  initialised, with the reason)."""
  saved = read_state(saved_path)
  prefix = 'ema.params.' if any(name.startswith('ema.params.') for name in saved) else 'model.'
  loaded, fresh = [], []
  for name, variable in _flat_variables(model):
    source = saved.get(prefix + name)
    if any(re.search(pattern, name) for pattern in exclude):
      fresh.append(f'{name} (init_exclude)')
    elif source is None:
      fresh.append(f'{name} (not in the checkpoint)')
    elif source.shape != variable.shape:
      fresh.append(f'{name} ({tuple(variable.shape)}, {tuple(source.shape)} there)')
    else:
      variable.set_value(jax.device_put(source, variable[...].sharding))
      loaded.append(name)
  logging.info('Initialised the model from %s: loaded %d arrays%s.', saved_path, len(loaded),
               f'; re-initialised {len(fresh)}: {", ".join(fresh)}' if fresh else '')
  return loaded, fresh


def _flat_variables(model: nnx.Module) -> list[tuple[str, nnx.Variable]]:
  """('conv1.kernel', its Variable) for every parameter and BatchNorm statistic."""
  state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
  return list(_flat(state, is_leaf=lambda x: isinstance(x, nnx.Variable)).items())


class _PolicyInfo(NamedTuple):
  """A saved step as Orbax's preservation policies read it (`PolicyCheckpointInfo`)."""
  step: int
  metrics: dict | None
  time: datetime.datetime


class Checkpoints:
  """The checkpoints of one workdir, through an `ocp.CheckpointManager`."""

  def __init__(self, workdir: str, best_metric: str | None = None, maximize: bool = True,
               max_to_keep: int = 3):
    """`best_metric` (with `maximize`) picks the epoch-end checkpoint kept as the best."""
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    logging.get_absl_handler().addFilter(_orbax_warnings_only)
    sign = 1 if maximize else -1
    score = lambda metrics: sign * metrics[best_metric]
    # Synchronous saves: the train step donates the state's buffers right after a save returns.
    # A save interrupted by a kill leaves a temporary directory, removed at the next start.
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
    if best_metric:
      policies.append(ocp.checkpoint_managers.BestN(get_metric_fn=score, n=1,
                                                    keep_checkpoints_without_metrics=False))
    self._policy = ocp.checkpoint_managers.AnyPreservationPolicy(policies)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True,
            best_fn=score if best_metric else None, best_mode='max',
            preservation_policy=self._policy),
        # Named handlers let a fresh process read the metadata of existing checkpoints.
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'progress': ocp.JsonCheckpointHandler()})

  def close(self) -> None:
    """Waits for Orbax's background work (such as deleting old checkpoints) and ends it."""
    self._manager.close()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def best_step(self) -> int | None:
    """The epoch-end checkpoint best by the metric; None when none carries metrics."""
    return self._manager.best_step()

  def latest_progress(self) -> dict | None:
    """The progress item of the newest checkpoint (JSON only, no arrays read), if any."""
    for step in reversed(self.all_steps()):
      try:
        return self._manager.restore(step, args=ocp.args.Composite(
            progress=ocp.args.JsonRestore()))['progress']
      except Exception:  # pylint: disable=broad-except  (a damaged one: try the one before)
        continue
    return None

  def warn_if_disk_low(self, state: nnx.Module) -> None:
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(state))
               if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    free = shutil.disk_usage(self.directory).free
    if free < _CHECKPOINTS_OF_SPACE * size:
      logging.warning('Only %.1f MB free in %s, less than %d checkpoints of %.1f MB: a save may '
                      'fail for lack of space.', free / 1e6, self.directory,
                      _CHECKPOINTS_OF_SPACE, size / 1e6)

  def save(self, step: int, state: nnx.Module, progress: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Saves checkpoint `step` of `state` with `progress` (and the eval `metrics` by which the
    best is kept); a `StorageError` if the disk is full or not writable, earlier ones intact."""
    start = time.time()
    try:
      with _reports_held():
        self._manager.save(step, metrics=metrics, args=ocp.args.Composite(
            state=ocp.args.StandardSave(nnx.state(state)),
            progress=ocp.args.JsonSave({**progress, 'layout': LAYOUT})))
    except Exception as error:  # pylint: disable=broad-except  (re-raised unless an OS error)
      if (reason := io_failure(error)) is None:
        raise
      # The run ends with this error. Orbax's other writer threads of this save may still be
      # writing into its temporary directory: it is removed before and after they stop.
      self._remove_partial_saves()
      with _reports_held():
        try:
          self._manager.wait_until_finished()
        except Exception:  # pylint: disable=broad-except  (the same failure, reported below)
          pass
      self._remove_partial_saves()
      kept = self.all_steps()
      earlier = (f'The earlier checkpoints (steps {", ".join(map(str, kept))}) are kept' if kept
                 else 'No earlier checkpoint was saved')
      raise errors.StorageError(
          f'Could not save the checkpoint at step {step} in {self.directory}: {reason}. '
          f'{earlier}; free space (or fix the permissions) and rerun the same command to '
          'resume.', path=self.directory, reason=reason) from error
    logging.info('Saved checkpoint at step %d in %.2fs.', step, time.time() - start)

  def record(self, step: int, progress: dict, metrics: dict[str, float]) -> None:
    """Adds to the saved checkpoint `step` what is known only after it: the eval `metrics` by
    which the best is kept, and the `progress` of the hooks that ran after the save (an epoch's
    checkpoint is saved before its evaluations, so that a failed evaluation loses no training).

    Orbax keeps both as JSON items of the step (its metrics item, this app's progress item):
    each is written to a temporary file renamed over the item, so a process killed meanwhile
    leaves the old or the new. `reload` then re-reads the steps' metrics, by which the next
    save's clean-up keeps the best."""
    if jax.process_index() == 0:
      step_directory = os.path.join(self.directory, str(step))
      for item, filename, value in (
          ('progress', 'metadata', {**progress, 'layout': LAYOUT}),
          (ocp.checkpoint_manager.METRIC_ITEM_NAME, ocp.checkpoint_manager.METRIC_ITEM_NAME,
           metrics)):
        os.makedirs(os.path.join(step_directory, item), exist_ok=True)
        path = os.path.join(step_directory, item, filename)
        with open(f'{path}.tmp', 'w', encoding='utf-8') as file:
          json.dump(value, file)
        os.replace(f'{path}.tmp', path)
    self._manager.reload()
    self._remove_unpreserved()

  def _remove_unpreserved(self) -> None:
    """Deletes the steps that the preservation policy no longer keeps now that a step's
    metrics are known (Orbax applies it at a save only, when the new step had none yet: an
    earlier best would otherwise stay until the next save, or for good after the last)."""
    checkpoints = [_PolicyInfo(step, self._manager.metrics(step), datetime.datetime.now())
                   for step in self._manager.all_steps()]
    kept = self._policy.should_preserve(
        checkpoints, context=ocp.checkpoint_managers.PreservationContext())
    for checkpoint, keep in zip(checkpoints, kept):
      if not keep:
        self._manager.delete(checkpoint.step)

  def _remove_partial_saves(self) -> None:
    """Deletes what a failed save left: its temporary directory, which holds the lost space."""
    for partial in glob.glob(os.path.join(self.directory, '*.orbax-checkpoint-tmp*')):
      shutil.rmtree(partial, ignore_errors=True)

  def _restore(self, step: int, state: nnx.Module) -> dict:
    """Restores checkpoint `step` into `state` (in place); returns its progress item.

    Its structure is checked first: a `CheckpointError` naming the differences if it does not
    fit the config, or if an older version of this app wrote it.
    """
    metadata = self._manager.item_metadata(step)
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
    with _reports_held():
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

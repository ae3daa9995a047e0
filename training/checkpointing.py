"""Orbax checkpoints: exact resume, preemption (SIGTERM/SIGINT) and non-finite-loss safety.

A checkpoint `<workdir>/checkpoints/<step>` holds three items:
  model: the full NNX state (Params, BatchStats and the dropout RngState), so a resumed run
    draws the same dropout masks as an uninterrupted one;
  train: the optimizer state and the train-metric sums not yet written to TensorBoard;
  progress: JSON {epoch, step_in_epoch, steps_per_epoch}: where the input pipeline continues
    (every epoch's shuffle order is derived from config.seed, so the position is enough).
Orbax writes a checkpoint into a temporary directory and renames it once complete, so a process
killed at any moment, even mid-save, leaves nothing that the next start would pick up: only
complete checkpoints are listed.
"""

import errno
import glob
import logging as python_logging
import os
import re
import shutil
import signal
import sys
import time

from absl import logging
from flax import nnx
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from data_sources import base
import models
from training import config_checks

CHECKPOINT_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt'  # Under CHECKPOINT_DIR: checkpoints that failed to restore.
_MAX_LISTED = 6  # Differing keys named in a mismatch error.
_CHECKPOINTS_OF_SPACE = 3  # Free space below this many checkpoints' size at start: a warning.


class NonFiniteError(RuntimeError):
  """The training loss or state became NaN/Inf; the message names the step and last checkpoint."""


class SaveError(OSError):
  """A checkpoint could not be written (full disk, lost permissions); earlier ones are intact."""


class Interrupted(Exception):
  """A SIGTERM/SIGINT stopped training after a checkpoint was saved."""

  def __init__(self, signum: int, step: int, directory: str, received_by: str = 'Received'):
    super().__init__(f'{received_by} {signal.Signals(signum).name}: saved a checkpoint at step '
                     f'{step} in {directory} and stopped. Rerun the same command to resume.')
    self.signum = signum


def io_failure(error: BaseException) -> str | None:
  """The OS's reason, such as 'No space left on device', if `error` is a failed write or read.

  Orbax's TensorStore and TensorFlow's file writers report OS errors inside their own exception
  types, with the errno in the message (os_error_code='28'); Python's with `OSError.errno`.
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
  """{'linear1.kernel.value': shape} for every leaf; PRNG keys count as their raw key data."""
  def name(path):
    return '.'.join(str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key))))
                    for key in path)
  def shape(leaf):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape)
  return {name(path): shape(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


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
  the same error to its caller, which reports it once.
  """
  if f'{os.sep}orbax{os.sep}' not in record.pathname:
    return True
  return (record.levelno >= python_logging.WARNING
          and 'raised an exception' not in record.getMessage())


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.array([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)
                            if jnp.issubdtype(leaf.dtype, jnp.inexact)]))


def _training_items(model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA | None,
                    metrics) -> dict:
  """The checkpoint items of a training run, except `progress`."""
  items = {'model': nnx.state(model),
           'train': {'optimizer': nnx.state(optimizer), 'metrics': metrics}}
  if ema is not None:
    items['ema'] = nnx.state(ema)
  return items


def create_ema(config: ml_collections.ConfigDict, model: nnx.Module) -> nnx.EMA | None:
  """The moving average of `model`'s parameters if config.ema_decay > 0, else None.

  BatchNorm's running statistics are averaged too: statistics of the current weights do not
  fit the averaged ones (eval accuracy 0.12 after 2 MNIST epochs with decay 0.999, in a run
  that trained at 0.98).
  """
  if not config.ema_decay:
    return None
  return nnx.EMA(model, config.ema_decay, only=nnx.Any(nnx.Param, nnx.BatchStat))


def maximizes(metric: str) -> bool:
  """Whether a larger value of `metric` is better: every metric but losses."""
  return not metric.endswith('loss')


class Checkpointer:
  """Saves and restores the training state of one workdir with an `ocp.CheckpointManager`."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict):
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    logging.get_absl_handler().addFilter(_orbax_warnings_only)
    self._config = config
    # Epoch-end checkpoints carry the eval metrics; the one best in config.best_metric is kept
    # besides the newest max_checkpoints_to_keep.
    sign = 1 if maximizes(config.best_metric) else -1
    score = lambda metrics: sign * metrics[config.best_metric]
    # Synchronous saves: the train step donates the model's buffers right after a save returns.
    # A save interrupted by a kill leaves a temporary directory, removed at the next start.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True,
            best_fn=score, best_mode='max',
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy([
                ocp.checkpoint_managers.LatestN(n=config.max_checkpoints_to_keep),
                ocp.checkpoint_managers.BestN(get_metric_fn=score, n=1,
                                              keep_checkpoints_without_metrics=False)])),
        # Named handlers let a fresh process read the metadata of existing checkpoints.
        item_handlers={'model': ocp.StandardCheckpointHandler(),
                       'train': ocp.StandardCheckpointHandler(),
                       'ema': ocp.StandardCheckpointHandler(),
                       'progress': ocp.JsonCheckpointHandler()})
    self._signal = None  # The SIGTERM/SIGINT received during training, if any.
    self._handlers = {}  # The signal handlers replaced while training.
    self._checked_step = 0  # Last step whose training loss was checked to be finite.
    self._dispatches = 0  # Calls of maybe_save: the same count on every process.
    # The best config.best_metric so far and its epoch (for early stopping), saved in progress.
    self.best = {'value': None, 'epoch': 0}

  def close(self) -> None:
    """Waits for Orbax's background work (such as deleting old checkpoints) and ends it."""
    self._manager.close()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def _restore(self, step: int, items: dict) -> dict:
    """Restores `items` (name -> target pytree) of checkpoint `step`, checking structure first."""
    metadata = self._manager.item_metadata(step)
    for name, target in items.items():
      if not metadata.get(name):
        raise FileNotFoundError(f'the metadata of its {name} state is missing')
      if differences := _differences(_flat_shapes(metadata[name]), _flat_shapes(target)):
        raise config_checks.ConfigError(
            f'The {name} state of the checkpoint at step {step} in {self.directory} does not '
            f'match the config ({"; ".join(differences)}). Use the config it was written with '
            '(model, optimizer, momentum, dataset), or a new --workdir.')
    start = time.time()
    restored = self._manager.restore(step, args=ocp.args.Composite(
        progress=ocp.args.JsonRestore(),
        **{name: ocp.args.StandardRestore(target) for name, target in items.items()}))
    logging.info('Restored checkpoint at step %d from %s in %.2fs.', step, self.directory,
                 time.time() - start)
    return restored

  def _restore_newest(self, items: dict, *, move_aside: bool) -> tuple[int, dict] | None:
    """Restores the newest checkpoint that restores: (step, items), or None if there is none.

    A checkpoint that fails to restore (a truncated or missing file) is reported with its step
    and the reason, and, when `move_aside`, moved into <checkpoints>/corrupt/ (never deleted),
    so that the next start does not trip over it again. Only when every checkpoint fails does
    this raise, naming them. A checkpoint whose intact state does not fit the config raises at
    once: an older one would not fit either.
    """
    steps = sorted(self.all_steps(), reverse=True)
    for step in steps:
      try:
        return step, self._restore(step, items)
      except config_checks.ConfigError:
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
    raise config_checks.ConfigError(
        f'None of the {len(steps)} checkpoints in {self.directory} (steps '
        f'{", ".join(map(str, steps))}) restores (see the warnings above; they are in {where}): '
        'pass a new --workdir, or rerun this one to train from scratch.')

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

  def restore_model(self, model: nnx.Module, checkpoint: str = 'latest',
                    ) -> tuple[nnx.Module, int]:
    """The model of a checkpoint, in eval mode, with the EMA weights when config.ema_decay.

    `checkpoint` is 'latest' (the newest that restores), 'best' (best config.best_metric at an
    epoch end) or a step number. Read-only: a damaged checkpoint is skipped, not moved (a
    training run may be using them). Returns the model and the checkpoint's step.
    """
    ema = create_ema(self._config, model)
    items = {'model': nnx.state(model), **({'ema': nnx.state(ema)} if ema else {})}
    if checkpoint != 'latest':
      step = self._chosen_step(checkpoint)
      restored = self._restore(step, items)
    elif newest := self._restore_newest(items, move_aside=False):
      step, restored = newest
    else:
      raise config_checks.ConfigError(
          f'No checkpoint in {self.directory}: train first with the same --workdir '
          '(python main.py --config=... --workdir=...).')
    nnx.update(model, restored['model'])
    if ema is not None:
      nnx.update(ema, restored['ema'])
      model = ema.apply_to(model)
    model.eval()
    return model, step

  def _chosen_step(self, checkpoint: str) -> int:
    """The step that --checkpoint=best or --checkpoint=STEP names."""
    steps = self.all_steps()
    if checkpoint == 'best':
      step = self._manager.best_step()  # None when no checkpoint has metrics.
      if step is None:
        raise config_checks.ConfigError(
            f'No checkpoint in {self.directory} has eval metrics to pick the best by (they are '
            'saved at epoch ends): use --checkpoint=latest or a step number.')
      return step
    if not checkpoint.isdigit() or int(checkpoint) not in steps:
      raise config_checks.ConfigError(
          f'--checkpoint={checkpoint} is not a checkpoint of {self.directory}: use best, '
          f'latest or one of the steps {", ".join(map(str, sorted(steps))) or "(none)"}.')
    return int(checkpoint)

  def restore_training(self, model: nnx.Module, optimizer: nnx.Optimizer,
                       ema: nnx.EMA | None, metrics, steps_per_epoch: int):
    """Resumes from the newest checkpoint that restores, if any: returns (step, metrics)."""
    items = _training_items(model, optimizer, ema, metrics)
    self._warn_if_disk_low(items)
    restored = self._restore_newest(items, move_aside=True)
    if restored is None:
      logging.info('No checkpoint in %s: training from scratch.', self.directory)
      return 0, metrics
    step, restored = restored
    if restored['progress']['steps_per_epoch'] != steps_per_epoch:
      raise config_checks.ConfigError(
          f'The checkpoint at step {step} in {self.directory} was written with '
          f'{restored["progress"]["steps_per_epoch"]} steps per epoch, but config.batch_size='
          f'{self._config.batch_size} and config.train_split={self._config.train_split!r} give '
          f'{steps_per_epoch}: resume with the same values to continue the same data order.')
    nnx.update(model, restored['model'])
    nnx.update(optimizer, restored['train']['optimizer'])
    if ema is not None:
      nnx.update(ema, restored['ema'])
    self.best = restored['progress'].get('best', self.best)
    self._checked_step = step
    return step, restored['train']['metrics']

  def record_eval(self, epoch: int, eval_metrics: dict[str, float]) -> None:
    """Notes an epoch's eval metrics: the best value of config.best_metric and its epoch."""
    value = eval_metrics[self._config.best_metric]
    best = self.best['value']
    if best is None or (value > best if maximizes(self._config.best_metric) else value < best):
      self.best = {'value': value, 'epoch': epoch}

  def _warn_if_disk_low(self, items: dict) -> None:
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(items)
               if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    free = shutil.disk_usage(self.directory).free
    if free < _CHECKPOINTS_OF_SPACE * size:
      logging.warning('Only %.1f MB free in %s, less than %d checkpoints of %.1f MB: a save may '
                      'fail for lack of space.', free / 1e6, self.directory,
                      _CHECKPOINTS_OF_SPACE, size / 1e6)

  def check_finite(self, step: int, metrics) -> None:
    """Halts (if config.halt_on_nonfinite) when the train loss of `metrics` is NaN or Inf.

    `metrics` are the train metrics since the last check; they are on the host already at the
    log interval, so this adds no device sync.
    """
    if not self._config.halt_on_nonfinite:
      return
    loss = float(metrics.compute()['loss'])
    if not jnp.isfinite(loss):
      self._halt(f'The training loss is {loss} in steps {self._checked_step + 1}-{step}')
    self._checked_step = step

  def _halt(self, what: str) -> None:
    latest = self.latest_step()
    last_good = (f'the last good checkpoint is step {latest} in {self.directory} (kept unchanged)'
                 if latest is not None else 'no checkpoint was saved before it')
    raise NonFiniteError(
        f'{what}: halting because config.halt_on_nonfinite is set; {last_good}. Try a lower '
        f'config.learning_rate (now {self._config.learning_rate}).')

  def maybe_save(self, first_step: int, step: int, num_steps: int, model: nnx.Module,
                 optimizer: nnx.Optimizer, ema: nnx.EMA | None, metrics, steps_per_epoch: int,
                 eval_metrics: dict[str, float] | None = None) -> None:
    """Saves after the dispatch of steps `first_step`..`step` when a checkpoint is due.

    Due every config.checkpoint_every_steps, at each epoch end (given its `eval_metrics`, by
    which the best checkpoint is kept), at the last step, and after a SIGTERM/SIGINT, which then
    raises `Interrupted`. Never saves a non-finite state when config.halt_on_nonfinite.
    """
    self._dispatches += 1
    preempted = self._signal or self._reached_preemption()
    every = self._config.checkpoint_every_steps
    if not (step // every > (first_step - 1) // every or step == num_steps or preempted
            or eval_metrics):
      return
    items = _training_items(model, optimizer, ema, metrics)
    if self._config.halt_on_nonfinite and not _all_finite(items):
      self._halt(f'The training state is not finite at step {step}')
    start = time.time()
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    unraisable = []  # What Orbax's writer threads fail to raise during the save.
    report_unraisable, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
      self._manager.save(step, args=ocp.args.Composite(
          progress=ocp.args.JsonSave({'epoch': epoch, 'step_in_epoch': step_in_epoch,
                                      'steps_per_epoch': steps_per_epoch, 'best': self.best}),
          **{name: ocp.args.StandardSave(item) for name, item in items.items()}),
          metrics=eval_metrics)
    except Exception as error:  # pylint: disable=broad-except  (re-raised unless an OS error)
      if (reason := io_failure(error)) is None:
        sys.unraisablehook = report_unraisable
        raise
      # The run ends with this error. Orbax's other writer threads of this save still stop one
      # by one (until exit), each reporting the event loop that the failed write closed: they
      # say nothing more than this error, so they are not printed.
      self._remove_partial_saves()
      kept = self.all_steps()
      raise SaveError(
          f'Could not save the checkpoint at step {step} in {self.directory}: {reason}. The '
          f'earlier checkpoints (steps {", ".join(map(str, kept)) or "none"}) are kept; free '
          'space (or fix the permissions) and rerun the same command to resume.') from error
    sys.unraisablehook = report_unraisable
    for report in unraisable:
      report_unraisable(report)
    logging.info('Saved checkpoint at step %d in %.2fs.', step, time.time() - start)
    if preempted and step < num_steps:
      if self._signal:
        raise Interrupted(self._signal, step, self.directory)
      raise Interrupted(signal.SIGTERM, step, self.directory,
                        received_by='Preempted: a process of this run received')

  def _remove_partial_saves(self) -> None:
    """Deletes what a failed save left: its temporary directory, which holds the lost space."""
    for partial in glob.glob(os.path.join(self.directory, '*.orbax-checkpoint-tmp*')):
      shutil.rmtree(partial, ignore_errors=True)

  def _reached_preemption(self) -> bool:
    """With several processes: whether all have reached the step to save at after a SIGTERM.

    JAX's runtime catches SIGTERM on any process and agrees with the others on the next dispatch
    they all save at, so every process saves the same step and exits the same way.
    """
    return (jax.process_count() > 1
            and multihost_utils.reached_preemption_sync_point(self._dispatches))

  def _on_signal(self, signum, frame) -> None:
    del frame
    logging.warning('Received %s: saving a checkpoint after the current step, then stopping '
                    '(send it again to stop at once).', signal.Signals(signum).name)
    self._signal = signum
    self._restore_handlers()

  def _restore_handlers(self) -> None:
    for signum, handler in self._handlers.items():
      signal.signal(signum, handler)
    self._handlers = {}

  def interruptible(self, batches):
    """Yields from `batches` with SIGTERM/SIGINT turned into a checkpoint and `Interrupted`.

    With several processes, JAX's runtime handles SIGTERM (see `_reached_preemption`), and
    SIGINT keeps its default: a save by one process alone would wait forever for the others.
    """
    if jax.process_count() == 1:
      self._handlers = {signum: signal.signal(signum, self._on_signal)
                        for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield from batches
    finally:
      self._restore_handlers()


def load_model(config: ml_collections.ConfigDict, workdir: str, info: base.DatasetInfo,
               checkpoint: str = 'latest') -> tuple[nnx.Module, int]:
  """The model of a checkpoint in `workdir` (see `Checkpointer.restore_model`) and its step."""
  model = models.create_compiled(lambda: models.create_model(
      config, info.image_shape, info.num_classes, nnx.Rngs(config.seed)))
  return Checkpointer(workdir, config).restore_model(model, checkpoint)

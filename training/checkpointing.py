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

import logging as python_logging
import os
import signal
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from data_sources import base
import models
from training import config_checks

CHECKPOINT_DIR = 'checkpoints'
_MAX_LISTED = 6  # Differing keys named in a mismatch error.


class NonFiniteError(RuntimeError):
  """The training loss or state became NaN/Inf; the message names the step and last checkpoint."""


class Interrupted(Exception):
  """A SIGTERM/SIGINT stopped training after a checkpoint was saved."""

  def __init__(self, signum: int, step: int, directory: str):
    super().__init__(f'Received {signal.Signals(signum).name}: saved a checkpoint at step {step} '
                     f'in {directory} and stopped. Rerun the same command to resume.')
    self.signum = signum


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


def _orbax_warnings_only(record) -> bool:
  """A logging filter: Orbax logs ~40 INFO lines per save; we log one line per save instead."""
  return (record.levelno >= python_logging.WARNING
          or f'{os.sep}orbax{os.sep}' not in record.pathname)


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.array([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)
                            if jnp.issubdtype(leaf.dtype, jnp.inexact)]))


def _training_items(model: nnx.Module, optimizer: nnx.Optimizer, metrics) -> dict:
  """The checkpoint items of a training run, except `progress`."""
  return {'model': nnx.state(model),
          'train': {'optimizer': nnx.state(optimizer), 'metrics': metrics}}


class Checkpointer:
  """Saves and restores the training state of one workdir with an `ocp.CheckpointManager`."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict):
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    logging.get_absl_handler().addFilter(_orbax_warnings_only)
    self._config = config
    # Synchronous saves: the train step donates the model's buffers right after a save returns.
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=config.max_checkpoints_to_keep,
                                             create=True, enable_async_checkpointing=False),
        # Named handlers let a fresh process read the metadata of existing checkpoints.
        item_handlers={'model': ocp.StandardCheckpointHandler(),
                       'train': ocp.StandardCheckpointHandler(),
                       'progress': ocp.JsonCheckpointHandler()})
    self._signal = None  # The SIGTERM/SIGINT received during training, if any.
    self._handlers = {}  # The signal handlers replaced while training.
    self._checked_step = 0  # Last step whose training loss was checked to be finite.

  def close(self) -> None:
    """Waits for Orbax's background work (such as deleting old checkpoints) and ends it."""
    self._manager.close()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def _restore(self, step: int, items: dict) -> dict:
    """Restores `items` (name -> target pytree) of checkpoint `step`, checking structure first."""
    metadata = self._manager.item_metadata(step)
    for name, target in items.items():
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

  def restore_model(self, model: nnx.Module) -> int:
    """Loads the latest checkpoint's model state into `model`; returns its step."""
    step = self.latest_step()
    if step is None:
      raise config_checks.ConfigError(
          f'No checkpoint in {self.directory}: train first with the same --workdir '
          '(python main.py --config=... --workdir=...).')
    nnx.update(model, self._restore(step, {'model': nnx.state(model)})['model'])
    return step

  def restore_training(self, model: nnx.Module, optimizer: nnx.Optimizer, metrics,
                       steps_per_epoch: int):
    """Resumes from the latest checkpoint, if any: returns (step, metrics)."""
    step = self.latest_step()
    if step is None:
      logging.info('No checkpoint in %s: training from scratch.', self.directory)
      return 0, metrics
    restored = self._restore(step, _training_items(model, optimizer, metrics))
    if restored['progress']['steps_per_epoch'] != steps_per_epoch:
      raise config_checks.ConfigError(
          f'The checkpoint at step {step} in {self.directory} was written with '
          f'{restored["progress"]["steps_per_epoch"]} steps per epoch, but config.batch_size='
          f'{self._config.batch_size} and config.train_split={self._config.train_split!r} give '
          f'{steps_per_epoch}: resume with the same values to continue the same data order.')
    nnx.update(model, restored['model'])
    nnx.update(optimizer, restored['train']['optimizer'])
    self._checked_step = step
    return step, restored['train']['metrics']

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
                 optimizer: nnx.Optimizer, metrics, steps_per_epoch: int) -> None:
    """Saves after the dispatch of steps `first_step`..`step` when a checkpoint is due.

    Due every config.checkpoint_every_steps, at the last step, and after a SIGTERM/SIGINT, which
    then raises `Interrupted`. Never saves a non-finite state when config.halt_on_nonfinite.
    """
    every = self._config.checkpoint_every_steps
    if not (step // every > (first_step - 1) // every or step == num_steps or self._signal):
      return
    items = _training_items(model, optimizer, metrics)
    if self._config.halt_on_nonfinite and not _all_finite(items):
      self._halt(f'The training state is not finite at step {step}')
    start = time.time()
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    self._manager.save(step, args=ocp.args.Composite(
        progress=ocp.args.JsonSave({'epoch': epoch, 'step_in_epoch': step_in_epoch,
                                    'steps_per_epoch': steps_per_epoch}),
        **{name: ocp.args.StandardSave(item) for name, item in items.items()}))
    logging.info('Saved checkpoint at step %d in %.2fs.', step, time.time() - start)
    if self._signal and step < num_steps:
      raise Interrupted(self._signal, step, self.directory)

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
    """Yields from `batches` with SIGTERM/SIGINT turned into a checkpoint and `Interrupted`."""
    self._handlers = {signum: signal.signal(signum, self._on_signal)
                      for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield from batches
    finally:
      self._restore_handlers()


def load_latest_model(config: ml_collections.ConfigDict, workdir: str,
                      info: base.DatasetInfo) -> tuple[nnx.Module, int]:
  """The model of the latest checkpoint in `workdir`, in eval mode, and its step."""
  model = models.create_compiled(lambda: models.create_model(
      config, info.image_shape, info.num_classes, nnx.Rngs(config.seed)))
  step = Checkpointer(workdir, config).restore_model(model)
  model.eval()
  return model, step

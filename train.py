"""Trains and evaluates an NNX image classifier: the story of one run, top to bottom."""

import concurrent.futures
import itertools
import os
import time

from absl import logging
from clu import parameter_overview
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from core import errors
from core import runtime
import input_pipeline
from training import checkpointing
from training import config_checks
from training import evaluation
from training import evaluators
from training import hooks
from training import losses
from training import optimizers
from training import parallel
from training import state as state_lib
from training import summaries
from training import workdirs


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains `config.model` on `config.dataset`, evaluating after every epoch and, with a
  `config.test_split`, testing the best checkpoint at the end. Returns the last epoch's train
  and eval metrics (and the test's)."""
  start = time.time()
  config_checks.check_config(config)
  checkpoints = checkpointing.Checkpoints(
      workdir, config.best_metric, config_checks.check_best_metric(config),
      config.max_checkpoints_to_keep)
  workdirs.check_resume_config(config, workdir, has_checkpoint=bool(checkpoints.all_steps()))
  if (done := _finished(config, workdir, checkpoints)) is not None:
    return done
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)  # The state is created replicated over all devices.
  data = input_pipeline.open_data(config)
  config_checks.check_against_data(config, data.info, jax.device_count())
  logging.info('Dataset: %s', data.info)
  workdirs.save_info(workdir, data.info)
  steps_per_epoch = data.info.num_train_examples // config.batch_size
  eval_split = evaluation.Evaluation('eval', evaluators.of_split(config, 'eval'), data.info,
                                     data.info.num_eval_examples)

  # Decoding the data (TensorFlow) and compiling (XLA) each leave part of the 2 cores idle:
  # side by side they took 6.3 s for MNIST here, one after the other 8.3 s.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as background:
    splits = background.submit(load_splits, config, data, mesh)
    loop = hooks.Loop(config, state_lib.create(config, data.info, steps_per_epoch),
                      steps_per_epoch, steps_per_epoch * config.num_epochs)
    train_step = _compile(config, loop.state, eval_split, data.info, mesh,
                          lambda: _class_counts(splits.result()[0], data.info))
    train_split, eval_batches = splits.result()
  parameter_overview.log_parameter_overview(
      nnx.to_pure_dict(nnx.state(loop.state.model, nnx.Param)), msg=f'{config.model} parameters')

  writer = summaries.create_writer(workdir)
  with runtime.StopSignals(jax.process_count()) as signals:
    place = lambda batch: parallel.shard(batch, mesh)
    batch_size = parallel.local_batch_size(config.batch_size)

    def epoch_tail(epoch: int):
      """The images of the last config.precise_bn_batches training batches of `epoch`, as eval
      prepares images (no random ops, no mixing): the statistics are for the eval images."""
      start = max(steps_per_epoch - config.precise_bn_batches, 0)
      return map(place, itertools.islice(input_pipeline.train_batches(
          train_split, data, config, batch_size, epoch, start, augment=False),
          steps_per_epoch - start))

    run_hooks = _hooks(config, workdir, loop, checkpoints, writer, eval_split, eval_batches,
                       epoch_tail, signals)
    _resume(loop, checkpoints, run_hooks, writer)
    logging.info('Training for %d epochs of %d steps (batch %d), from step %d.',
                 config.num_epochs, steps_per_epoch, config.batch_size, loop.step)
    batches = input_pipeline.train_batches(train_split, data, config, batch_size,
                                           *divmod(loop.step, steps_per_epoch))
    hooks.run(loop, run_hooks, batches, train_step, place)
  if signals.received is not None:
    writer.close()
    checkpoints.close()
    raise runtime.Interrupted(signals.received, loop.step, checkpoints.directory)
  if loop.stop:
    logging.info('Stopped after epoch %d: %s.', loop.epoch, loop.stop)
  final = {**loop.metrics}
  if config.test_split:
    final.update(_test_best(config, data, checkpoints, loop, mesh, writer))
  writer.close()
  checkpoints.close()
  _log_summary(config, workdir, checkpoints, time.time() - start)
  return final


def _finished(config, workdir: str, checkpoints: checkpointing.Checkpoints) -> dict | None:
  """The final metrics of a run that is already done (its last epoch, early stop and test
  all saved), logged with its summary; None if there is training (or testing) left to do."""
  progress = checkpoints.latest_progress()
  if progress is None or progress.get('layout') != checkpointing.LAYOUT:
    return None
  stopped = progress['hooks'].get('early_stopping', {}).get('stopped')
  if progress['epoch'] < config.num_epochs and not stopped:
    return None
  metrics = summaries.read_metrics(workdir)
  last = metrics.get(progress['epoch'] * progress['steps_per_epoch'], {})
  if config.test_split and not any(name.startswith('test/') for name in last):
    return None
  logging.info('This run finished already (epoch %d of %d): nothing to train. Raise '
               'config.num_epochs to train on, or pass a new --workdir.', progress['epoch'],
               config.num_epochs)
  _log_summary(config, workdir, checkpoints, None)
  return last


def load_splits(config, data: input_pipeline.Data, mesh: jax.sharding.Mesh):
  """This process's training split and the whole eval split as device batches."""
  train_split = input_pipeline.open_split(
      data, parallel.process_split(config.train_split, drop_remainder=True), config)
  if not isinstance(train_split, input_pipeline.Streamed):
    input_pipeline.log_class_counts(train_split.labels, data.info.class_names,
                                    config.train_split)
  return train_split, parallel.eval_batches(data, config.eval_split,
                                            data.info.num_eval_examples, config, mesh)


def _class_counts(train_split, info) -> np.ndarray:
  """The training examples of each class, over all processes; the split must be in memory."""
  if isinstance(train_split, input_pipeline.Streamed):
    raise errors.ConfigError(
        "The loss needs the training split's class counts, which a streamed split does not "
        "give: set config.in_memory='always', or give the class weights as numbers.",
        key='in_memory', value='never')
  return parallel.sum_over_processes(np.bincount(train_split.labels,
                                                 minlength=info.num_classes))


def _compile(config, state: state_lib.TrainState, eval_split: evaluation.Evaluation, info,
             mesh: jax.sharding.Mesh, class_counts):
  """The train step, compiled with the eval step for the batches to come, before they exist
  (their first calls reuse these executables): while the data is still decoding.

  `class_counts()` gives the training examples of each class, for losses that need them."""
  logging.info('Compiling the train and eval steps.')
  train_step = state_lib.make_train_step(
      losses.LOSSES.create(config, info.num_classes, class_counts))
  batch = {'image': ((config.batch_size, *info.image_shape), np.float32),
           'label': ((config.batch_size,), np.int32)}
  if input_pipeline.mixes(config):
    batch['target'] = ((config.batch_size, info.num_classes), np.float32)
  train_step.lower(state, parallel.abstract_batch(batch, mesh)).compile()
  size = parallel.eval_batch_size(config, mesh)
  eval_split.compile(state.eval_model(), parallel.abstract_batch(
      {'image': ((size, *info.image_shape), np.float32), 'label': ((size,), np.int32),
       'mask': ((size,), np.bool_)}, mesh))
  return train_step


def _hooks(config, workdir: str, loop: hooks.Loop, checkpoints: checkpointing.Checkpoints,
           writer, eval_split: evaluation.Evaluation, eval_batches, epoch_tail,
           signals: runtime.StopSignals) -> list[hooks.Hook]:
  """The loop's hooks, in the order they run after each step."""
  guard = hooks.NonFiniteGuard(checkpoints, config.log_every_steps,
                               check_loss=config.nonfinite == 'halt')
  schedule = optimizers.create_learning_rate_schedule(config, loop.steps_per_epoch)
  run_hooks = [hooks.Progress()]
  if config.profile_steps:
    run_hooks.append(hooks.Profiler(workdir, config.profile_steps))
  run_hooks.append(guard)
  run_hooks.append(hooks.TrainMetrics(writer, schedule, config.log_every_steps,
                                      config.batch_size))
  if config.precise_bn_batches and state_lib.has_batch_norm(loop.state.model):
    run_hooks.append(hooks.PreciseBatchNorm(epoch_tail))
  run_hooks.append(hooks.Evaluate(eval_split, eval_batches, writer))
  if config.early_stopping_patience:
    run_hooks.append(hooks.EarlyStopping(
        config.best_metric, config_checks.check_best_metric(config),
        config.early_stopping_patience, config.early_stopping_min_delta))
  run_hooks.append(hooks.StopOnSignal(signals))
  return run_hooks + [hooks.Checkpointing(checkpoints, config.checkpoint_every_steps,
                                          run_hooks, guard)]


def _resume(loop: hooks.Loop, checkpoints: checkpointing.Checkpoints,
            run_hooks: list[hooks.Hook], writer) -> None:
  """Restores the newest checkpoint that restores, and the hooks' state; or starts afresh."""
  checkpoints.warn_if_disk_low(loop.state)
  restored = checkpoints.restore_newest(loop.state, move_aside=True)
  if restored is None and loop.config.init_from:
    _init_from(loop.config, loop.config.init_from, loop.state)
  if restored is None:
    logging.info('No checkpoint in %s: training from scratch.', checkpoints.directory)
    summaries.write_config(writer, os.path.dirname(checkpoints.directory), loop.config,
                           _hparams_metrics(loop.config))
    return
  loop.step, progress = restored
  if progress['steps_per_epoch'] != loop.steps_per_epoch:
    raise errors.ConfigError(
        f'The checkpoint at step {loop.step} in {checkpoints.directory} was written with '
        f'{progress["steps_per_epoch"]} steps per epoch, but the training split now gives '
        f'{loop.steps_per_epoch}: resume with the same data to continue the same data order, '
        'or pass a new --workdir.', key='train_split', value=loop.config.train_split)
  for hook in run_hooks:
    if hook.name in progress['hooks']:
      hook.load_state_dict(progress['hooks'][hook.name])


def _init_from(config, path: str, state: state_lib.TrainState) -> None:
  """Starts the model from the weights of `path` (config.init_from): a workdir's best
  checkpoint (else its newest), or a checkpoint directory; see `checkpointing.init_weights`."""
  saved_path = checkpointing.checkpoint_path(path)
  if (source := workdirs.saved_config(path)) is not None:
    best = checkpointing.Checkpoints(path, source.best_metric,
                                     config_checks.check_best_metric(source)).best_step()
    if best is not None:
      saved_path = os.path.join(path, checkpointing.CHECKPOINT_DIR, str(best), 'state')
  loaded, _ = checkpointing.init_weights(state.model, saved_path, tuple(config.init_exclude))
  if not loaded:
    raise errors.ConfigError(
        f'config.init_from={path!r}: no parameter of its checkpoint {saved_path} has the path '
        f'and shape of one of model {state.model.__class__.__name__!r}: is it the same kind of '
        'model?', key='init_from', value=path)
  if state.ema is not None:  # The average starts at the loaded weights.
    # Copies: the train step donates both, so they must not share buffers.
    jax.tree.map(lambda average, variable: average.set_value(jnp.copy(variable[...])),
                 state.ema.params,
                 nnx.state(state.model, state.ema.filter),
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


def _hparams_metrics(config) -> list[str]:
  """The metric columns of TensorBoard's HParams dashboard: every eval and test scalar."""
  return [f'{split}/{name}' for split in ('eval', 'test')
          for name in evaluators.directions(evaluators.of_split(config, split))]


def _test_best(config, data: input_pipeline.Data, checkpoints: checkpointing.Checkpoints,
               loop: hooks.Loop, mesh: jax.sharding.Mesh, writer) -> dict[str, float]:
  """Scores the best checkpoint (by config.best_metric) on config.test_split, once.

  The best is chosen among the epoch-end checkpoints on the eval split alone; the test split
  never takes part in any choice.
  """
  step = checkpoints.restore(loop.state, 'best')
  logging.info('Testing the best checkpoint (step %d) on %r.', step, config.test_split)
  test_split = evaluation.Evaluation('test', evaluators.of_split(config, 'test'), data.info,
                                     data.info.num_test_examples)
  result = test_split.run(loop.state.eval_model(), parallel.eval_batches(
      data, config.test_split, data.info.num_test_examples, config, mesh))
  writer.write_scalars(loop.step, result.scalars)
  if result.images:
    writer.write_images(loop.step, result.images)
  logging.info('test (best checkpoint: step %d): %s (%d examples of %r)', step,
               ' '.join(f'{name}={value:.4f}' for name, value in result.scalars.items()),
               result.num_examples, config.test_split)
  return result.scalars


def _log_summary(config, workdir: str, checkpoints: checkpointing.Checkpoints,
                 seconds: float | None) -> None:
  """What the run achieved and where everything is, with the commands to run next."""
  if jax.process_index() > 0:
    return
  metrics = summaries.read_metrics(workdir)
  evals = {step: values for step, values in metrics.items() if config.best_metric in values}
  lines = []
  if evals:
    last = max(evals)
    best = checkpoints.best_step() or last
    took = f' in {hooks.duration(seconds)}' if seconds is not None else ''
    value = lambda step: evals.get(step, evals[last])[config.best_metric]
    lines.append(f'Done{took}: {config.best_metric} {value(last):.4f} at the last epoch (step '
                 f'{last}), best {value(best):.4f} (step {best}, kept as --checkpoint=best).')
    if tests := {name: value for name, value in metrics[max(metrics)].items()
                 if name.startswith('test/')}:
      lines.append('Test of the best checkpoint: ' + ' '.join(
          f'{name}={value:.4f}' for name, value in tests.items()) + '.')
  lines += [f'Checkpoints: {checkpoints.directory}; metrics: '
            f'{os.path.join(workdir, summaries.METRICS_FILE)}.',
            f'See the curves: tensorboard --logdir {workdir}',
            f'Classify images: python main.py --workdir={workdir} --mode=predict --inputs=PATH']
  for line in lines:
    logging.info('%s', line)

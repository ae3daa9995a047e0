"""Trains and evaluates an NNX image classifier: the story of one run, top to bottom."""

from collections.abc import Iterable
import concurrent.futures
import functools
import time

from absl import logging
from clu import metric_writers
from clu import metrics as clu_metrics
from clu import parameter_overview
from clu import periodic_actions
import flax
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import data_sources
from data_sources import base
import input_pipeline
import models
from training import checkpointing
from training import config_checks
from training import optimizers
from training import parallel
from training import profiling
from training import summaries
from training import workdirs


@flax.struct.dataclass
class Metrics(clu_metrics.Collection):
  """Mean loss and accuracy; `accuracy.count` is the number of examples seen."""
  loss: clu_metrics.Average.from_output('loss')
  accuracy: clu_metrics.Accuracy


def compute_metrics(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> Metrics:
  logits = logits.astype(jnp.float32)  # A bfloat16 model's too: the loss in float32.
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return Metrics.single_from_model_output(loss=loss, logits=logits, labels=labels, mask=mask)


def train_loss(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
  """The mean cross-entropy of `logits` (in float32) against `labels` smoothed by
  `label_smoothing` (config.label_smoothing)."""
  logits = logits.astype(jnp.float32)
  if not label_smoothing:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets).mean()


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: input_pipeline.Batch,
               label_smoothing: float = 0.0) -> Metrics:
  """One SGD step on one batch; updates `model` and `optimizer` in place.

  The returned train loss is the plain cross-entropy, comparable with the eval loss.
  """

  def loss_fn(model):
    logits = model(batch['image'])
    return train_loss(logits, batch['label'], label_smoothing), logits

  (_, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return compute_metrics(logits, batch['label'])


@nnx.jit(donate_argnames=('model', 'optimizer', 'ema', 'metrics'),
         static_argnames=('label_smoothing',))
def train_steps(model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA | None,
                metrics: Metrics, batches: input_pipeline.Batch,
                label_smoothing: float = 0.0) -> Metrics:
  """Runs one train step per leading index of `batches` in a single dispatch.

  After each step the moving average `ema` (if any) takes in the new parameters. Returns
  `metrics` merged with those of every step; nothing is copied to the host. The steps are
  unrolled at trace time: XLA:CPU runs a conv net ~6x slower inside a `lax.scan` loop.
  """
  for i in range(len(batches['label'])):
    batch = jax.tree.map(lambda x, i=i: x[i], batches)
    metrics = metrics.merge(train_step(model, optimizer, batch, label_smoothing))
    if ema is not None:
      ema.update(model)
  return metrics


@nnx.jit
def eval_step(model: nnx.Module, metrics: Metrics,
              batch: input_pipeline.Batch) -> tuple[Metrics, jax.Array]:
  """Adds one padded batch to `metrics` (mask-0 examples do not count); returns predictions."""
  logits = model(batch['image'])
  return (metrics.merge(compute_metrics(logits, batch['label'], batch['mask'])),
          logits.argmax(axis=-1))


def evaluate(model: nnx.Module, batches: Iterable[input_pipeline.Batch],
             prefix: str = 'eval') -> tuple[dict[str, float], np.ndarray]:
  """Scores `model` in eval mode (running BatchNorm averages, no dropout) on every batch.

  Returns the metrics (named '<prefix>_loss', ...) and the predicted class of every real (mask 1) example, in order.
  `batches` is read once (a streamed split is read from its files on each pass).
  """
  model.eval()
  metrics = Metrics.empty()
  predictions = []
  for batch in batches:
    metrics, predicted = eval_step(model, metrics, batch)
    predictions.append((predicted, batch['mask']))
  model.train()
  return summarize(metrics, prefix), np.concatenate(
      [parallel.to_host(predicted)[parallel.to_host(mask)] for predicted, mask in predictions])


def summarize(metrics: Metrics, prefix: str) -> dict[str, float]:
  """Host-side scalars such as {'eval_loss', 'eval_accuracy', 'eval_num_examples'}."""
  values = {f'{prefix}_{name}': float(value) for name, value in metrics.compute().items()}
  values[f'{prefix}_num_examples'] = int(metrics.accuracy.count)
  return values


def load_data(config: ml_collections.ConfigDict, source: base.DataSource,
              info: base.DatasetInfo, mesh: jax.sharding.Mesh,
              ) -> tuple[base.Split | input_pipeline.Streamed, Iterable[input_pipeline.Batch]]:
  """This process's training split and the whole eval split as device batches.

  Each is in memory or streamed from its files, as config.in_memory says.
  """
  open_split = functools.partial(input_pipeline.open_split, source, config=config)
  train_split = open_split(parallel.process_split(config.train_split, drop_remainder=True))
  return train_split, parallel.eval_batches(open_split, config.eval_split,
                                            info.num_eval_examples, config, mesh)


def create_model_and_optimizer(
    config: ml_collections.ConfigDict, info: base.DatasetInfo, steps_per_epoch: int,
) -> tuple[nnx.Module, nnx.Optimizer, nnx.EMA | None, optax.Schedule]:
  """The model, its optimizer, the moving average of its weights if config.ema_decay, and the
  learning rate by (0-based) training step, as `config` says."""
  schedule = optimizers.create_learning_rate_schedule(config, steps_per_epoch)

  def create():
    model = models.create_model(config, info.image_shape, info.num_classes,
                                nnx.Rngs(config.seed))
    return (model, nnx.Optimizer(model, optimizers.create_optimizer(config, schedule),
                                 wrt=nnx.Param),
            checkpointing.create_ema(config, model))

  model, optimizer, ema = models.create_compiled(create)
  return model, optimizer, ema, optimizers.learning_rate_by_step(config, schedule)


def compile_steps(model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA | None,
                  config: ml_collections.ConfigDict, info: base.DatasetInfo,
                  mesh: jax.sharding.Mesh) -> None:
  """Compiles the train and eval steps for the shapes of the batches to come.

  The steps' first calls reuse these executables, so this can run before the batches exist:
  while the data is still decoding.
  """
  chunk = parallel.abstract_batch(
      {'image': ((config.steps_per_dispatch, config.batch_size, *info.image_shape), np.float32),
       'label': ((config.steps_per_dispatch, config.batch_size), np.int32)}, mesh, axis=1)
  train_steps.lower(model, optimizer, ema, Metrics.empty(), chunk,
                    config.label_smoothing).compile()
  eval_batch_size = parallel.eval_batch_size(config, mesh)
  batch = parallel.abstract_batch(
      {'image': ((eval_batch_size, *info.image_shape), np.float32),
       'label': ((eval_batch_size,), np.int32), 'mask': ((eval_batch_size,), np.bool_)}, mesh)
  evaluated = eval_model(model, ema)
  evaluated.eval()
  eval_step.lower(evaluated, Metrics.empty(), batch).compile()
  model.train()


def eval_model(model: nnx.Module, ema: nnx.EMA | None) -> nnx.Module:
  """The model to evaluate: `model` with the moving-average weights when there are some."""
  return model if ema is None else ema.apply_to(model)


def test_best_checkpoint(config: ml_collections.ConfigDict, checkpoints: checkpointing.Checkpointer,
                         model: nnx.Module, source: base.DataSource, info: base.DatasetInfo,
                         mesh: jax.sharding.Mesh) -> dict[str, float]:
  """Scores the best checkpoint (by config.best_metric) on config.test_split, once.

  The best is chosen among the epoch-end checkpoints on the eval split alone; the test split
  never takes part in any choice.
  """
  best, step = checkpoints.restore_model(model, 'best')
  batches = parallel.eval_batches(
      functools.partial(input_pipeline.open_split, source, config=config), config.test_split,
      info.num_test_examples, config, mesh)
  metrics, _ = evaluate(best, batches, prefix='test')
  logging.info('test (best checkpoint: step %d, %s=%.4f): test_loss=%.4f test_accuracy=%.4f '
               '(%d examples of %r)', step, config.best_metric,
               checkpoints.best['value'], metrics['test_loss'], metrics['test_accuracy'],
               metrics['test_num_examples'], config.test_split)
  return metrics


def early_stopped(config: ml_collections.ConfigDict, checkpoints: checkpointing.Checkpointer,
                  epoch: int) -> bool:
  """Whether config.early_stopping_patience epochs passed without a better best_metric."""
  patience = config.early_stopping_patience
  waited = epoch - checkpoints.best['epoch']
  if not patience or checkpoints.best['value'] is None or waited < patience:
    return False
  logging.info('Stopping early after epoch %d: %s has not improved for %d epochs (best %.4f at '
               'epoch %d; config.early_stopping_patience=%d).', epoch, config.best_metric,
               waited, checkpoints.best['value'], checkpoints.best['epoch'], patience)
  return True


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains `config.model` on `config.dataset`, evaluating after every epoch.

  Returns the metrics of the last epoch: train_* (mean over the epoch) and eval_* (whole split).
  """
  config_checks.check_config(config)
  config_checks.check_workdir(workdir)
  config_checks.check_against_devices(config, jax.device_count())
  checkpoints = checkpointing.Checkpointer(workdir, config)
  workdirs.check_resume_config(config, workdir, has_checkpoint=bool(checkpoints.all_steps()))
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)  # Model state and metrics are created replicated over all devices.

  source = data_sources.open_source(config)
  info = source.info(config)
  config_checks.check_against_data(config, info.num_train_examples)
  config_checks.check_augment(config, info.image_shape)
  logging.info('Dataset: %s', info)
  if jax.process_index() == 0:  # For predict and export, which then need no data.
    data_sources.save_info(workdir, info)
  steps_per_epoch = info.num_train_examples // config.batch_size
  num_steps = steps_per_epoch * config.num_epochs

  # Decoding the data (TensorFlow) and compiling (XLA) each leave part of the 2 cores idle:
  # side by side they took 6.3 s for MNIST here, one after the other 8.3 s.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as background:
    data = background.submit(load_data, config, source, info, mesh)
    model, optimizer, ema, schedule = create_model_and_optimizer(config, info, steps_per_epoch)
    compile_steps(model, optimizer, ema, config, info, mesh)
    train_split, eval_batches = data.result()
  # On the host once for the eval images, rather than copied back from the devices every epoch
  # (a streamed eval split keeps only its labels, and reads the images drawn again).
  eval_examples = None
  if config.num_misclassified_images:
    eval_examples = (eval_batches.real_examples(parallel.to_host)
                     if isinstance(eval_batches, input_pipeline.StreamedBatches)
                     else summaries.real_examples(eval_batches))
  parameter_overview.log_parameter_overview(nnx.state(model, nnx.Param).to_pure_dict(),
                                            msg=f'{config.model} parameters')
  # Window (since the last train-metrics write) and epoch metrics continue where they stopped.
  step, (window_metrics, epoch_metrics) = checkpoints.restore_training(
      model, optimizer, ema, (Metrics.empty(), Metrics.empty()), steps_per_epoch)

  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  if not step:  # A resumed run wrote its config already.
    summaries.write_config(writer, workdir, config)
  # Called once per dispatch, so it triggers on time and at every epoch end (always the end of
  # a dispatch), not every N steps, which would need a call after every single step.
  report_progress = periodic_actions.ReportProgress(
      num_train_steps=num_steps, writer=writer, every_secs=10,
      on_steps=range(steps_per_epoch, num_steps + 1, steps_per_epoch))
  profile = profiling.create_profiler(config, workdir, step, steps_per_epoch)

  logging.info('Training for %d epochs of %d steps (batch %d).', config.num_epochs,
               steps_per_epoch, config.batch_size)
  epoch_start = time.time()
  final_metrics = {}
  stopped = early_stopped(config, checkpoints, step // steps_per_epoch)
  for batches in checkpoints.interruptible(input_pipeline.train_batches(
      train_split, parallel.process_config(config), *divmod(step, steps_per_epoch))):
    if stopped:  # A run resumed after it stopped early goes straight to the test.
      break
    batches = parallel.shard(batches, mesh, axis=1)
    window_metrics = train_steps(model, optimizer, ema, window_metrics, batches,
                                 config.label_smoothing)
    first_step, step = step + 1, step + len(batches['label'])
    report_progress(step)
    profile(step)

    end_of_epoch = step % steps_per_epoch == 0
    if step // config.log_every_steps > (first_step - 1) // config.log_every_steps or end_of_epoch:
      # The only host sync of the loop: once per log interval.
      epoch_metrics = epoch_metrics.merge(window_metrics)
      writer.write_scalars(step, {**summarize(window_metrics, 'train'),
                                  'learning_rate': float(schedule(step - 1))})
      checkpoints.check_finite(step, window_metrics)
      window_metrics = Metrics.empty()

    eval_metrics = None
    if end_of_epoch:
      with report_progress.timed('eval'):
        eval_metrics, predictions = evaluate(eval_model(model, ema), eval_batches)
      writer.write_scalars(step, eval_metrics)
      writer.flush()  # Read by sweep.py's pruner while the run goes on.
      summaries.write_eval_images(writer, step, predictions, eval_examples, info.num_classes,
                                  config.num_misclassified_images)
      final_metrics = {**summarize(epoch_metrics, 'train'), **eval_metrics}
      logging.info(
          'epoch %d/%d: train_loss=%.4f train_accuracy=%.4f eval_loss=%.4f eval_accuracy=%.4f '
          '(%d examples) in %.1fs', step // steps_per_epoch, config.num_epochs,
          final_metrics['train_loss'], final_metrics['train_accuracy'],
          final_metrics['eval_loss'], final_metrics['eval_accuracy'],
          final_metrics['eval_num_examples'], time.time() - epoch_start)
      epoch_metrics = Metrics.empty()
      epoch_start = time.time()
      checkpoints.record_eval(step // steps_per_epoch, eval_metrics)
      stopped = early_stopped(config, checkpoints, step // steps_per_epoch)
    checkpoints.maybe_save(first_step, step, num_steps, model, optimizer, ema,
                           (window_metrics, epoch_metrics), steps_per_epoch, eval_metrics)

  if config.test_split:
    final_metrics.update(test_best_checkpoint(config, checkpoints, model, source, info, mesh))
    writer.write_scalars(step, {key: value for key, value in final_metrics.items()
                                if key.startswith('test_')})
  writer.close()
  checkpoints.close()
  return final_metrics


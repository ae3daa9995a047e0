"""Trains and evaluates an NNX image classifier: the story of one run, top to bottom."""

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import time

from absl import logging
from clu import metric_writers
from clu import parameter_overview
from flax import nnx
import jax
import numpy as np

from core import errors
from core import progress
from core import runtime
from data_sources import base
import input_pipeline
from training import calibration
from training import checkpointing
from training import evaluation
from training import feature_cache
from training import hooks
from training import init_from
from training import loggers
from training import parallel
from training import provenance
from training import run_spec
from training import state as state_lib
from training import summaries
from training import workdirs


@dataclasses.dataclass(frozen=True)
class Session:
  """What a training run has open: its description, workdir, data, devices and outputs."""
  run: run_spec.Run
  workdir: str
  data: input_pipeline.Data
  mesh: jax.sharding.Mesh
  checkpoints: checkpointing.Checkpoints
  writer: metric_writers.MetricWriter
  eval_batch_size: int  # run.eval_batch_size rounded up to a multiple of the device count.

  def place(self, batch: input_pipeline.Batch):
    """This process's share of a batch as global arrays, split over the devices."""
    return parallel.shard(batch, self.mesh)


def train_and_evaluate(run: run_spec.Run, workdir: str) -> dict[str, float]:
  """Trains `run.model` on its data, running its evaluations at their cadences (those at the end
  with the best checkpoint). Returns the last step's train and evaluation metrics (and those of
  the evaluations at the end)."""
  start = time.time()
  with contextlib.ExitStack() as stack:
    checkpoints = checkpointing.Checkpoints(workdir, run.best.name, run.best.maximize,
                                            run.max_checkpoints_to_keep)
    stack.callback(checkpoints.close)
    workdirs.check_resume_config(run.settings, workdir,
                                 has_checkpoint=bool(checkpoints.all_steps()))
    if (done := _finished(run, workdir, checkpoints)) is not None:
      return done
    if run.init_from and not checkpoints.all_steps():  # A resumed run needs its own alone.
      run.init_from.check()  # Downloads now: before the data is read.
    mesh = parallel.create_mesh(run.fsdp)
    jax.set_mesh(mesh)  # The state is created over the mesh: replicated, or split (FSDP).
    data = input_pipeline.open_data(run.input, run.eval_splits())
    run.check_against_data(data.info, jax.device_count())
    logging.info('Dataset: %s', data.info)
    workdirs.save_info(workdir, data.info)
    provenance.record_start(workdir, run, data.info)
    session = Session(run, workdir, data, mesh, checkpoints,
                      loggers.create_writer(run.loggers, workdir), _eval_batch_size(run, mesh))
    stack.callback(session.writer.close)
    steps_per_epoch = data.info.num_train_examples // run.batch_size
    schedule = run.optimization.learning_rate_schedule(steps_per_epoch)
    # Three things at once, each leaving cores idle: decoding the data (TensorFlow), compiling
    # the train and eval steps for the state's shapes (XLA), and creating the state (XLA
    # compiles and runs its initialisers: tens of seconds for a ViT on a TPU).
    planned = state_lib.plan(run.model, data.info, run.optimization, schedule, seed=run.seed,
                             ema_decay=run.ema_decay)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as background:
      splits = background.submit(_open_splits, session)
      compiling = background.submit(_compile, session, planned.abstract,
                                    lambda: _class_counts(splits.result()[0], data.info))
      loop = hooks.Loop(planned.build(), steps_per_epoch, steps_per_epoch * run.num_epochs)
      train_step = compiling.result()
      train_split, eval_batches = splits.result()
    parameter_overview.log_parameter_overview(
        nnx.to_pure_dict(nnx.state(loop.state.model, nnx.Param)),
        msg=f'{run.model.name} parameters')
    with runtime.StopSignals(jax.process_count()) as signals:
      run_hooks = _hooks(session, loop, schedule, train_split, eval_batches, signals)
      _resume(session, loop, run_hooks)
      logging.info('Training for %d epochs of %d steps (batch %d), from step %d.',
                   run.num_epochs, steps_per_epoch, run.batch_size, loop.step)
      batches = _train_batches(session, loop, train_split)
      hooks.run(loop, run_hooks, batches, train_step, session.place, run.batch_size)
    if signals.received is not None:
      raise runtime.Interrupted(signals.received, loop.step, checkpoints.directory)
    if loop.stop:
      logging.info('Stopped after epoch %d: %s.', loop.epoch, loop.stop)
    final = dict(loop.metrics)
    for at_end in _evaluations(run, during_training=False):
      final.update(_evaluate_best(session, at_end, loop))
    if run.temperature_scaling:
      _fit_temperature(session, loop)
  _log_summary(run, workdir, checkpoints, time.time() - start)
  return final


def _finished(run: run_spec.Run, workdir: str,
              checkpoints: checkpointing.Checkpoints) -> dict | None:
  """The final metrics of a run that is already done (its last epoch or early stop, and its
  evaluations at the end, all saved), logged with its summary; None if there is training (or
  an evaluation) left to do."""
  progress = checkpoints.latest_progress()
  if (progress is None or progress.get('layout') != checkpointing.LAYOUT
      or not hooks.Hooks.finished(progress, run.num_epochs)):
    return None
  metrics = summaries.read_metrics(workdir)
  last = metrics.get(progress['epoch'] * progress['steps_per_epoch'], {})
  if any(not any(name.startswith(f'{at_end.name}/') for name in last)
         for at_end in _evaluations(run, during_training=False)):
    return None
  logging.info('This run finished already (epoch %d of %d): nothing to train. Raise '
               'config.num_epochs to train on, or pass a new --workdir.', progress['epoch'],
               run.num_epochs)
  _log_summary(run, workdir, checkpoints, None)
  return last


def _evaluations(run: run_spec.Run, during_training: bool) -> list[evaluation.Evaluation]:
  """The run's evaluations that run during training (every epoch or N steps), or at the end."""
  return [candidate for candidate in run.evaluations
          if (candidate.every != evaluation.AT_END) == during_training]


def _eval_batch_size(run: run_spec.Run, mesh: jax.sharding.Mesh) -> int:
  """run.eval_batch_size rounded up to a multiple of the device count (said once)."""
  size = parallel.round_up(run.eval_batch_size, mesh)
  if size != run.eval_batch_size:
    logging.info('Eval batch size %d rounded up to %d, a multiple of the %d devices.',
                 run.eval_batch_size, size, mesh.size)
  return size


def _eval_batches(session: Session, evaluation_: evaluation.Evaluation, reference: bool = False):
  """The sharded, masked eval batches of an evaluation's split (or, with `reference`, of its
  reference split; None if it has none); each example counts once."""
  if reference and not evaluation_.reference:
    return None
  name = run_spec.reference_name(evaluation_.name) if reference else evaluation_.name
  return input_pipeline.open_eval_batches(
      session.data, session.run.input, evaluation_.reference if reference else evaluation_.split,
      session.data.eval_sizes[name], session.eval_batch_size, evaluation_.preprocess,
      session.place)


def _open_splits(session: Session):
  """This process's training split, and the eval batches of the evaluations during training."""
  run, data = session.run, session.data
  train_split = input_pipeline.open_split(
      data, input_pipeline.process_split(run.input.train_split, drop_remainder=True), run.input)
  if not isinstance(train_split, input_pipeline.Streamed):
    input_pipeline.log_class_counts(train_split.labels, data.info.class_names,
                                    run.input.train_split)
  return train_split, {candidate.name: (_eval_batches(session, candidate),
                                        _eval_batches(session, candidate, reference=True))
                       for candidate in _evaluations(run, during_training=True)}


def _class_counts(train_split, info: base.DatasetInfo) -> np.ndarray:
  """The training examples of each class, over all processes; the split must be in memory."""
  if isinstance(train_split, input_pipeline.Streamed):
    raise errors.ConfigError(
        "The loss needs the training split's class counts, which a streamed split does not "
        "give: set config.in_memory='always', or give the class weights as numbers.",
        key='in_memory', value='never')
  return parallel.sum_over_processes(np.bincount(train_split.labels,
                                                 minlength=info.num_classes))


def _compile(session: Session, state: state_lib.TrainState, class_counts):
  """The train step, compiled with the eval steps for the batches to come, before they exist
  (their first calls reuse these executables): for `state`'s shapes and shardings (an abstract
  state will do), while the data is still decoding and the state is created.

  `class_counts()` gives the training examples of each class, for losses that need them."""
  logging.info('Compiling the train and eval steps.')
  run, info = session.run, session.data.info
  probe_features = run.probe_views is not None
  train_step = state_lib.make_train_step(run.loss(info.num_classes, class_counts),
                                         run.input.preprocess, features=probe_features)
  compiled = None
  # In the mesh the training loop calls them in: a thread starts without the process's.
  with jax.set_mesh(session.mesh):
    if not probe_features:  # The step of features compiles in moments, on its first batch.
      compiled = train_step.lower(state, parallel.abstract_batch(
          input_pipeline.batch_layout(info, run.batch_size, train=run.input),
          session.mesh)).compile()
    eval_layout = parallel.abstract_batch(
        input_pipeline.batch_layout(info, session.eval_batch_size, mask=True), session.mesh)
    for during in _evaluations(run, during_training=True):
      during.compile(state.eval_model(), eval_layout, info)
  if compiled is not None:  # Released, the compiler's freed memory adds nothing to its peak.
    runtime.release_compiler_memory(compiled)
  return train_step


def _train_batches(session: Session, loop: hooks.Loop, train_split):
  """The training batches from `loop.step` to the end: of images, or of a linear probe's
  cached features (computed here, by the model as loaded)."""
  run = session.run
  batch_size = parallel.local_batch_size(run.batch_size)
  start = divmod(loop.step, loop.steps_per_epoch)
  if run.probe_views is None:
    return input_pipeline.read_ahead(input_pipeline.train_batches(
        train_split, session.data, run.input, batch_size, *start))
  views = feature_cache.compute(loop.state.model, train_split, session.data, run.input,
                                batch_size, loop.steps_per_epoch, run.probe_views,
                                run.num_epochs, session.place)
  return feature_cache.batches(views, run.seed, batch_size, *start, run.num_epochs)


def _hooks(session: Session, loop: hooks.Loop, schedule, train_split, eval_batches: dict,
           signals: runtime.StopSignals) -> hooks.Hooks:
  """The loop's hooks, in the order they run after each step, and the checkpoint saves."""
  run = session.run
  guard = hooks.NonFiniteGuard(session.checkpoints, run.log_every_steps,
                               check_loss=run.nonfinite == 'halt')
  train_metrics = hooks.TrainMetrics(session.writer, run.optimization, schedule,
                                     run.log_every_steps, run.batch_size)
  run_hooks = [hooks.Progress()]
  if run.profile_steps:
    run_hooks.append(hooks.Profiler(session.workdir, run.profile_steps))
  run_hooks += [guard, train_metrics]
  if run.precise_bn_batches and state_lib.has_batch_norm(loop.state.model):
    run_hooks.append(hooks.PreciseBatchNorm(
        lambda epoch: _epoch_tail(session, train_split, loop.steps_per_epoch, epoch)))
  run_hooks += [hooks.Evaluate(during, *eval_batches[during.name], session.data.info,
                               session.writer, train_metrics if during.name == 'eval' else None,
                               session.data.eval_sizes[during.name])
                for during in _evaluations(run, during_training=True)]
  if run.early_stopping_patience:
    run_hooks.append(hooks.EarlyStopping(run.best.name, run.best.maximize,
                                         run.early_stopping_patience,
                                         run.early_stopping_min_delta))
  run_hooks.append(hooks.StopOnSignal(signals))
  return hooks.Hooks(run_hooks, hooks.Checkpointing(session.checkpoints,
                                                    run.checkpoint_every_steps, guard))


def _epoch_tail(session: Session, train_split, steps_per_epoch: int, epoch: int):
  """The images of the last run.precise_bn_batches training batches of `epoch`, as eval
  prepares images (no random ops, no mixing): the statistics are for the eval images."""
  start = max(steps_per_epoch - session.run.precise_bn_batches, 0)
  return state_lib.scaled(map(session.place, itertools.islice(input_pipeline.train_batches(
      train_split, session.data, session.run.input,
      parallel.local_batch_size(session.run.batch_size), epoch, start, augment=False),
      steps_per_epoch - start)), session.data.preprocess)


def _resume(session: Session, loop: hooks.Loop, run_hooks: hooks.Hooks) -> None:
  """Restores the newest checkpoint that restores, and the hooks' state; or starts afresh."""
  run, checkpoints = session.run, session.checkpoints
  checkpoints.warn_if_disk_low(loop.state)
  restored = checkpoints.restore_newest(loop.state, move_aside=True)
  if restored is None and run.init_from:
    init_from.load(run.init_from, loop.state, run.model, session.data.info)
  if restored is None:
    logging.info('No checkpoint in %s: training from scratch.', checkpoints.directory)
    loggers.write_config(session.writer, session.workdir, run.settings, run.hparam_metrics())
    return
  loop.step, progress = restored
  if progress['steps_per_epoch'] != loop.steps_per_epoch:
    raise errors.ConfigError(
        f'The checkpoint at step {loop.step} in {checkpoints.directory} was written with '
        f'{progress["steps_per_epoch"]} steps per epoch, but the training split now gives '
        f'{loop.steps_per_epoch}: resume with the same data to continue the same data order, '
        'or pass a new --workdir.', key='train_split', value=run.input.train_split)
  run_hooks.load_state_dict(progress['hooks'])


def _evaluate_best(session: Session, at_end: evaluation.Evaluation,
                   loop: hooks.Loop) -> dict[str, float]:
  """Scores the best checkpoint (by run.best) with an evaluation at the end, once.

  The best is chosen among the epoch-end checkpoints by the evaluations during training alone;
  the test split never takes part in any choice.
  """
  step = session.checkpoints.restore(loop.state, 'best')
  logging.info('Evaluating the best checkpoint (step %d) with %s on %r.', step, at_end.name,
               at_end.split)
  result = at_end.run(loop.state.eval_model(), _eval_batches(session, at_end),
                      session.data.info, session.data.eval_sizes[at_end.name],
                      _eval_batches(session, at_end, reference=True))
  session.writer.write_scalars(loop.step, result.scalars)
  if result.images:
    session.writer.write_images(loop.step, result.images)
  logging.info('%s (best checkpoint: step %d): %s (%d examples of %r)', at_end.name, step,
               ' '.join(f'{name}={value:.4f}' for name, value in result.scalars.items()
                        if not name.endswith('/num_examples')),
               result.num_examples, at_end.split)
  return result.scalars


def _fit_temperature(session: Session, loop: hooks.Loop) -> None:
  """Fits the temperature of the best checkpoint on the eval split and saves it in the workdir
  (training's own evaluations, the test split's included, score the logits as they are)."""
  scored = session.run.evaluation('eval')
  step = session.checkpoints.restore(loop.state, 'best')
  fit = calibration.fit_temperature(*calibration.collect_logits(
      loop.state.eval_model(), state_lib.scaled(_eval_batches(session, scored),
                                                scored.preprocess)))
  if jax.process_index() == 0:
    path = calibration.save_temperature(session.workdir, fit, split=scored.split, step=step)
    logging.info('Temperature scaling: T=%.4f fitted on %r (best checkpoint, step %d): its NLL '
                 '%.4f -> %.4f; eval, predict and export divide the logits by T (%s).',
                 fit.temperature, scored.split, step, fit.nll_before, fit.nll_after, path)


def _log_summary(run: run_spec.Run, workdir: str, checkpoints: checkpointing.Checkpoints,
                 seconds: float | None) -> None:
  """What the run achieved and where everything is, with the commands to run next."""
  if jax.process_index() > 0:
    return
  metrics = summaries.read_metrics(workdir)
  evals = {step: values for step, values in metrics.items() if run.best.name in values}
  lines = []
  if evals:
    last = max(evals)
    best = checkpoints.best_step() or last
    took = f' in {progress.duration(seconds)}' if seconds is not None else ''
    value = lambda step: evals.get(step, evals[last])[run.best.name]
    lines.append(f'Done{took}: {run.best.name} {value(last):.4f} at the last epoch (step '
                 f'{last}), best {value(best):.4f} (step {best}, kept as --checkpoint=best).')
    at_end = tuple(f'{candidate.name}/' for candidate in _evaluations(run, False))
    if at_end and (scores := {name: value for name, value in metrics[max(metrics)].items()
                              if name.startswith(at_end) and not name.endswith('/num_examples')}):
      lines.append('Scores of the best checkpoint: ' + ' '.join(
          f'{name}={value:.4f}' for name, value in scores.items()) + '.')
  lines += [f'Checkpoints: {checkpoints.directory}; metrics: '
            f'{os.path.join(workdir, summaries.METRICS_FILE)}.',
            f'See the curves: tensorboard --logdir {workdir}',
            f'Classify images: python main.py --workdir={workdir} --mode=predict --inputs=PATH']
  for line in lines:
    logging.info('%s', line)

"""The training loop's hooks: each watches the steps go by and owns its own state.

After every train step the loop calls each hook's `after_step(loop)` in order; hooks read the
`Loop` (step, epoch, state) and add to it: the scalars of the step (`loop.metrics`, e.g. the
eval results at an epoch end, recorded into the checkpoint saved before them) and a reason to stop
(`loop.stop`). What a hook offers other hooks it exposes as attributes (`TrainMetrics.epoch`,
`EarlyStopping.ended_run`). `Hooks` holds them in order with the checkpoints: it saves every
stateful hook's state (`state_dict`) in the checkpoint's progress item, restores it
(`load_state_dict`) and says whether a saved run is finished. `every` is the one cadence helper.
"""

import math
import signal
import time

from absl import logging
from clu import metric_writers
from clu import periodic_actions
import jax
import optax

from core import errors
from core import progress
from core import runtime
from data_sources import base
from training import checkpointing
from training import evaluation
from training import optimizers
from training import state as state_lib


class Loop:
  """What the hooks see of the run after a step, and what they tell each other."""

  def __init__(self, state: state_lib.TrainState, steps_per_epoch: int, num_steps: int,
               step: int = 0):
    self._state = state
    self._stepper = None  # Holds the state's arrays while steps run (`train`).
    self.steps_per_epoch, self.num_steps = steps_per_epoch, num_steps
    self.step = step  # Steps done.
    self.metrics: dict[str, float] = {}  # Of this step.
    self.stop: str | None = None  # Why the run stops before num_steps, once a hook says so.
    self.dispatched: jax.Array | None = None  # The step count after the last step dispatched:
    # ready when that step is done (no host sync to read whether it is).

  @property
  def state(self) -> state_lib.TrainState:
    """The training state after the last step (its arrays written back into its modules)."""
    if self._stepper is not None:
      self._stepper.sync()
    return self._state

  def train(self, train_step: state_lib.TrainStep, batch) -> None:
    """Dispatches one step of `train_step` on `batch`, and counts it."""
    if self._stepper is None:
      self._stepper = state_lib.Stepper(train_step, self._state)
    self.dispatched = self._stepper(batch)
    self.step += 1

  @property
  def epoch(self) -> int:
    """The epochs done (counting the one this step ends)."""
    return self.step // self.steps_per_epoch

  @property
  def num_epochs(self) -> int:
    return self.num_steps // self.steps_per_epoch

  @property
  def end_of_epoch(self) -> bool:
    return self.step % self.steps_per_epoch == 0

  @property
  def last_step(self) -> bool:
    return self.step == self.num_steps


def every(step: int, period: int) -> bool:
  """Whether a task due every `period` steps is due at `step` (1-based)."""
  return period > 0 and step % period == 0


class Hook:
  """A hook that does nothing; subclasses override what they need."""
  name = ''  # Key of its state in the checkpoint's progress item (stateful hooks only).
  ended_run = False  # Whether it ended the run before its last step, for good (not a signal).
  # Whether it evaluates, or reads what evaluations found: these run last, before the step's
  # checkpoint is saved with their metrics; if one fails, the checkpoint is saved without them
  # first, so that a failed evaluation loses no training.
  evaluates = False

  def on_start(self, loop: Loop) -> None:
    """Called once before the first step (after a resume restored the hooks' state)."""

  def on_end(self, loop: Loop) -> None:
    """Called once when the loop ends, however it ends."""

  def after_step(self, loop: Loop) -> None:
    """Called after every train step."""

  def state_dict(self) -> dict:
    return {}

  def load_state_dict(self, saved: dict) -> None:
    del saved


class Progress(Hook):
  """A progress line every `every_seconds` while steps finish: the steps the device has
  finished (not those dispatched, which run far ahead when steps are slow), steps/s and an ETA
  from them.

  Hand-written rather than clu's `ReportProgress`, whose ETA is whole minutes (a run with 40 s
  left reads 'ETA: 0m'). The rate is measured over the whole run since its first finished step,
  evals included, so the ETA counts the evals still to come. The lines come from a background
  thread (`progress.Ticker`), so they keep coming while the loop waits on the device; none while
  no step finishes (an evaluation prints its own).
  """

  def __init__(self, every_seconds: float = 10.0, poll_seconds: float = 0.5):
    self._every, self._poll = every_seconds, poll_seconds
    self._finished = self._rate = self._ticker = None
    self._shape = (0, 1)  # (num_steps, steps_per_epoch) of the loop.
    self._last_line = (0.0, 0)  # (time, step) of the last line.

  def on_start(self, loop):
    self._shape = loop.num_steps, loop.steps_per_epoch
    self._finished = progress.Finished(loop.step)
    self._rate = progress.Rate(loop.step, loop.num_steps)
    self._last_line = time.time(), loop.step
    self._ticker = progress.Ticker(self._tick, self._poll).start()

  def after_step(self, loop):
    self._finished.dispatched(loop.step, loop.dispatched)

  def on_end(self, loop):
    self._ticker.stop()

  def _tick(self) -> None:
    done = self._finished.count()
    measured = self._rate.update(done)
    num_steps, steps_per_epoch = self._shape
    if (measured is None or done == self._last_line[1]
        or (time.time() - self._last_line[0] < self._every and done < num_steps)):
      return
    self._last_line = time.time(), done
    rate, left = measured
    logging.info('step %d/%d (%.1f%%, epoch %d/%d): %.1f steps/s, ETA %s', done, num_steps,
                 100 * done / num_steps, min(done // steps_per_epoch + 1,
                                             num_steps // steps_per_epoch),
                 num_steps // steps_per_epoch, rate, progress.duration(left))


class Profiler(Hook):
  """A trace of `config.profile_steps` steps for TensorBoard's profile plugin, after
  `WARMUP_STEPS` more steps than the run starts at, into <workdir>/plugins/profile/."""
  # Steps run before the trace starts, so that it shows the steady state rather than the first
  # steps' one-off costs (input pipeline start-up, first transfers).
  WARMUP_STEPS = 5

  def __init__(self, workdir: str, num_steps: int):
    self._workdir, self._num_steps = workdir, num_steps
    self._profile = None

  def on_start(self, loop):
    if loop.step + self.WARMUP_STEPS + self._num_steps > loop.num_steps:
      raise errors.ConfigError(
          f'config.profile_steps={self._num_steps} does not fit in the {loop.num_steps} steps '
          f'of this run after step {loop.step} with its {self.WARMUP_STEPS} warm-up steps.',
          key='profile_steps', value=self._num_steps)
    self._profile = periodic_actions.Profile(
        logdir=self._workdir, num_profile_steps=self._num_steps, profile_duration_ms=None,
        first_profile=loop.step + self.WARMUP_STEPS, every_secs=None)

  def after_step(self, loop):
    self._profile(loop.step)


class NonFiniteGuard(Hook):
  """Halts the run, saving nothing, when the whole state is not finite before a save, and, with
  `check_loss` (config.nonfinite='halt'), when the training loss is NaN/Inf at a train-metrics
  write. With config.nonfinite='skip', updates with non-finite gradients are skipped instead,
  and a batch's NaN loss alone does not halt."""

  def __init__(self, checkpoints: checkpointing.Checkpoints, every_steps: int,
               check_loss: bool = True):
    self._checkpoints, self._every, self._check_loss = checkpoints, every_steps, check_loss
    self._checked = 0  # The last step whose loss was checked.

  def on_start(self, loop):
    self._checked = loop.step

  def after_step(self, loop):
    if self._check_loss and (every(loop.step, self._every) or loop.end_of_epoch):
      loss = float(loop.state.window.loss[...])
      if not math.isfinite(loss):
        self._halt(f'The training loss is {loss} in steps {self._checked + 1}-{loop.step}',
                   loop.step)
      self._checked = loop.step

  def check_state(self, loop: Loop) -> None:
    if not state_lib.all_finite(loop.state):
      self._halt(f'The training state is not finite at step {loop.step}', loop.step)

  def _halt(self, what: str, step: int) -> None:
    steps = self._checkpoints.all_steps()
    last = steps[-1] if steps else None
    kept = (f'the last good checkpoint is step {last} in {self._checkpoints.directory} (kept '
            'unchanged)' if last is not None else 'no checkpoint was saved before it')
    raise errors.NonFiniteError(
        f'{what}: halting, saving nothing; {kept}. Try a lower config.learning_rate, or '
        "config.nonfinite='skip' to skip updates with NaN/Inf gradients.", step=step,
        last_checkpoint=last)


class TrainMetrics(Hook):
  """Writes the train loss and accuracy since the last write, and the learning rate, every
  `every_steps` and at epoch ends; at an epoch end, also the epoch's means (`epoch`, and into
  `loop.metrics`) and its training speed (examples/s, evals excluded)."""

  def __init__(self, writer: metric_writers.MetricWriter,
               optimization: optimizers.Optimization, schedule: optax.Schedule,
               every_steps: int, batch_size: int):
    self._writer, self._optimization, self._schedule = writer, optimization, schedule
    self._every, self._batch_size = every_steps, batch_size
    self._epoch_start = None  # (time, step) at the first step of the epoch.
    self.epoch: dict[str, float] = {}  # The last epoch's means: {'train/loss_epoch': ...}.

  def after_step(self, loop):
    if self._epoch_start is None or loop.step % loop.steps_per_epoch == 1:
      # Timed from the end of the epoch's first step (the first epoch's compilation apart),
      # which is dispatched but may still run.
      jax.block_until_ready(loop.dispatched)
      self._epoch_start = time.time(), loop.step
    if not (every(loop.step, self._every) or loop.end_of_epoch):
      return
    scalars = {**loop.state.window.results(),  # The only host sync of the loop.
               'learning_rate': self._optimization.learning_rate_at(self._schedule, loop.step)}
    loop.state.window.reset()
    if loop.end_of_epoch:
      seconds = time.time() - self._epoch_start[0]
      steps = loop.step - self._epoch_start[1]
      scalars.update({'train/examples_per_sec': steps * self._batch_size / max(seconds, 1e-9),
                      'epoch': loop.epoch})
      self.epoch = {f'{name}_epoch': value for name, value in loop.state.epoch.results().items()}
      loop.metrics.update(self.epoch)
      loop.state.epoch.reset()
    self._writer.write_scalars(loop.step, scalars)


class PreciseBatchNorm(Hook):
  """At every epoch end, before the evaluation, recomputes the BatchNorm statistics of the
  model to evaluate (the EMA's, with config.ema_decay) over the images of the epoch's last
  training batches (`state_lib.recompute_batch_statistics`). `epoch_tail(epoch)` gives those
  images again from the input pipeline, prepared as eval prepares its own (no random ops, no
  mixing: the statistics are for the images the model is evaluated on); a function of (seed,
  epoch), so a resumed run recomputes the same statistics."""

  def __init__(self, epoch_tail):
    self._epoch_tail = epoch_tail

  def after_step(self, loop):
    if loop.end_of_epoch:
      state_lib.recompute_batch_statistics(loop.state.eval_model(),
                                           self._epoch_tail(loop.epoch - 1))


class Evaluate(Hook):
  """Runs one evaluation at its cadence (every epoch end, or every N steps): its scalars into
  `loop.metrics` and the writer, its pictures to TensorBoard, and a line in the log (at epoch
  ends with the epoch's train metrics, when given `train_metrics`)."""

  # An eval that took longer than this is announced before it runs: nothing stays silent long.
  ANNOUNCE_SECONDS = 5.0
  evaluates = True

  def __init__(self, evaluation_: evaluation.Evaluation, batches, reference,
               info: base.DatasetInfo, writer: metric_writers.MetricWriter,
               train_metrics: TrainMetrics | None = None, num_examples: int | None = None):
    """`reference`: the batches of the evaluation's reference split (None if it has none);
    `num_examples`: the split's size, for the ETA of a long evaluation's progress lines."""
    self._evaluation, self._batches, self._info = evaluation_, batches, info
    self._reference = reference
    self._num_examples = num_examples
    self._writer, self._train_metrics = writer, train_metrics
    self._since = time.time()  # The last line's time.
    self._last_seconds = None  # How long the last eval took.

  def after_step(self, loop):
    if not self._evaluation.due(loop.step, loop.end_of_epoch):
      return
    if self._last_seconds is None or self._last_seconds > self.ANNOUNCE_SECONDS:
      logging.info('Evaluating %s on %r at step %d.', self._evaluation.name,
                   self._evaluation.split, loop.step)
    start = time.time()
    result = self._evaluation.run(loop.state.eval_model(), self._batches, self._info,
                                  self._num_examples, self._reference)
    self._last_seconds = time.time() - start
    loop.metrics.update(result.scalars)
    self._writer.write_scalars(loop.step, result.scalars)
    if result.images:
      self._writer.write_images(loop.step, result.images)
    self._writer.flush()  # Read by sweep.py's pruner while the run goes on.
    shown = {**(self._train_metrics.epoch if self._train_metrics else {}), **result.scalars}
    where = (f'epoch {loop.epoch}/{loop.num_epochs}' if loop.end_of_epoch else
             f'step {loop.step} (epoch {loop.epoch + 1}/{loop.num_epochs})')
    logging.info('%s: %s (%d examples) in %.1fs', where, ' '.join(
        f'{name}={value:.4f}' for name, value in shown.items()
        if not name.endswith('/num_examples')), result.num_examples, time.time() - self._since)
    self._since = time.time()


class EarlyStopping(Hook):
  """Stops the run after `patience` epochs whose `metric` did not beat the best by more than
  `min_delta` (as Keras's EarlyStopping); its best value and epoch resume with the run.

  It follows its own best rather than the best checkpoint's, which counts any improvement:
  with `min_delta` the two may differ (the best checkpoint is still the best).
  """
  name = 'early_stopping'
  evaluates = True

  def __init__(self, metric: str, maximize: bool, patience: int, min_delta: float):
    self._metric, self._sign = metric, 1 if maximize else -1
    self._patience, self._min_delta = patience, min_delta
    self._best, self._best_epoch = None, 0

  def state_dict(self):
    return {'best': self._best, 'best_epoch': self._best_epoch}

  def load_state_dict(self, saved):
    self._best, self._best_epoch = saved['best'], saved['best_epoch']

  def on_start(self, loop):
    self._check(loop)  # A run resumed after it stopped early goes straight to the end.

  def after_step(self, loop):
    if not loop.end_of_epoch:
      return
    value = loop.metrics[self._metric]
    if self._best is None or self._sign * (value - self._best) > self._min_delta:
      self._best, self._best_epoch = value, loop.epoch
    self._check(loop)

  def _check(self, loop: Loop) -> None:
    waited = loop.epoch - self._best_epoch
    if self._best is not None and waited >= self._patience and not loop.last_step:
      self.ended_run = True
      loop.stop = (f'early stopping: {self._metric} has not improved by more than '
                   f'{self._min_delta} for {waited} epochs (best {self._best:.4f} at epoch '
                   f'{self._best_epoch}; config.early_stopping_patience={self._patience})')


class StopOnSignal(Hook):
  """Stops the run at the step where a stop signal arrived (or, with several processes, the
  step all agreed on): the checkpoint hook saves it, then the run exits with the signal."""

  def __init__(self, signals: runtime.StopSignals):
    self._signals = signals

  def after_step(self, loop):
    if self._signals.reached(loop.step) and not loop.last_step:
      loop.stop = f'received {signal.Signals(self._signals.received).name}'


class Checkpointing:
  """Saves every `every_steps`, at every epoch end, at the last step and when the run stops
  early; never a non-finite state. An epoch's checkpoint is saved after its evaluations, with
  their metrics (by which the best is kept) and every hook's state."""

  def __init__(self, checkpoints: checkpointing.Checkpoints, every_steps: int,
               guard: NonFiniteGuard | None):
    self._checkpoints, self._every, self._guard = checkpoints, every_steps, guard

  def after_step(self, loop: Loop, hooks: 'Hooks', evaluated: bool = True) -> None:
    """Saves the step if one is due: at an epoch end with its eval metrics, once `evaluated`
    (else without them: its evaluation failed)."""
    if not (every(loop.step, self._every) or loop.end_of_epoch or loop.last_step or loop.stop):
      return
    if self._guard:
      self._guard.check_state(loop)
    metrics = dict(loop.metrics) if loop.end_of_epoch and evaluated else {}
    self._checkpoints.save(loop.step, loop.state, self._progress(loop, hooks), metrics)

  @staticmethod
  def _progress(loop: Loop, hooks: 'Hooks') -> dict:
    epoch, step_in_epoch = divmod(loop.step, loop.steps_per_epoch)
    return {'epoch': epoch, 'step_in_epoch': step_in_epoch,
            'steps_per_epoch': loop.steps_per_epoch, 'stopped_early': hooks.ended_run,
            'hooks': hooks.state_dict()}


class Hooks:
  """The loop's hooks in order, then the checkpoint save that holds their state: first those
  that prepare the step's state, then those that evaluate it (`Hook.evaluates`: the
  evaluations and early stopping), whose metrics an epoch's checkpoint is saved with. Saves
  and restores every stateful hook, and says whether a run is done."""

  def __init__(self, hooks: list[Hook], checkpointing_: Checkpointing):
    self._hooks, self._checkpointing = hooks, checkpointing_

  @property
  def ended_run(self) -> bool:
    """Whether a hook ended the run for good before its last step (early stopping)."""
    return any(hook.ended_run for hook in self._hooks)

  def state_dict(self) -> dict:
    return {hook.name: hook.state_dict() for hook in self._hooks if hook.name}

  def load_state_dict(self, saved: dict) -> None:
    for hook in self._hooks:
      if hook.name in saved:
        hook.load_state_dict(saved[hook.name])

  @staticmethod
  def finished(progress: dict, num_epochs: int) -> bool:
    """Whether the run whose newest checkpoint saved `progress` has nothing left to train."""
    return progress['epoch'] >= num_epochs or progress.get('stopped_early', False)

  def on_start(self, loop: Loop) -> None:
    for hook in self._hooks:
      hook.on_start(loop)

  def on_end(self, loop: Loop) -> None:
    for hook in self._hooks:
      hook.on_end(loop)

  def after_step(self, loop: Loop) -> None:
    for hook in self._hooks:
      if not hook.evaluates:
        hook.after_step(loop)
    try:
      for hook in self._hooks:
        if hook.evaluates:
          hook.after_step(loop)
    except BaseException:
      self._checkpointing.after_step(loop, self, evaluated=False)
      raise
    self._checkpointing.after_step(loop, self)


def run(loop: Loop, hooks: Hooks, batches, train_step, place, batch_size: int) -> None:
  """Trains on `batches` (of `batch_size` examples over all devices) from `loop.step` until
  they end or a hook stops the run; a step that does not fit in memory ends it with
  `errors.OutOfMemory` naming config.batch_size."""
  hooks.on_start(loop)
  try:
    if loop.stop:
      return
    for batch in batches:
      loop.train(train_step, place(batch))
      loop.metrics = {}
      hooks.after_step(loop)
      if loop.stop:
        return
  except jax.errors.JaxRuntimeError as error:
    if not errors.OutOfMemory.caused(error):
      raise
    raise errors.OutOfMemory(
        f'A training step at config.batch_size={batch_size} does not fit in memory '
        f'({errors.OutOfMemory.reason(error)}): lower config.batch_size (or use '
        'config.grad_accum_steps to keep the batch the update sees), then rerun to resume.',
        key='batch_size', value=batch_size) from error
  finally:
    hooks.on_end(loop)

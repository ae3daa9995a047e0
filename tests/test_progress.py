"""Memory and progress at large sizes: progress counts finished work, a step that does not fit
ends with one typed error, an epoch's checkpoint is saved before its evaluation, the eval batch
is sized from the training batch, and a convolution whose patches are too large runs stock."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from core import errors
from core import progress
from kernels import cpu
from training import checkpointing
from training import hooks
from training import run_spec
from training import state as state_lib
from tests.helpers.build import INFO
from tests.helpers.build import create
from tests.helpers.build import random_batch


class _Result:
  """An array stand-in whose readiness the test sets."""

  def __init__(self):
    self.ready = False

  def is_ready(self):
    return self.ready


def test_finished_counts_work_whose_result_is_ready_in_order():
  finished = progress.Finished(start=3)
  results = [_Result() for _ in range(3)]
  for count, result in zip((4, 5, 6), results):
    finished.dispatched(count, result)
  assert finished.count() == 3  # Dispatched, none finished.
  results[0].ready = results[2].ready = True
  assert finished.count() == 4  # Work finishes in order: 6 waits for 5.
  results[1].ready = True
  assert finished.count() == 6


def test_rate_starts_at_the_first_finished_unit():
  rate = progress.Rate(start=0, total=10)
  assert rate.update(0) is None  # Nothing finished (compiling): no rate.
  assert rate.update(2) is None  # The first finished: the clock starts.
  per_second, left = rate.update(6)
  assert per_second > 0 and left == pytest.approx(4 / per_second)


def test_progress_lines_count_finished_steps_not_dispatched_ones(monkeypatch):
  state, train_step = create(model='mlp')
  lines = []
  monkeypatch.setattr(hooks.logging, 'info', lambda message, *args: lines.append(args))
  loop = hooks.Loop(state, steps_per_epoch=4, num_steps=8)
  progress_hook = hooks.Progress(every_seconds=0.0, poll_seconds=3600)  # Ticks by hand.
  progress_hook.on_start(loop)
  gate = _Result()
  for _ in range(3):
    loop.train(train_step, random_batch())
    progress_hook.after_step(loop)
  jax.block_until_ready([marker for _, marker in progress_hook._finished._pending])
  progress_hook._finished.dispatched(4, gate)  # A 4th step whose result is not ready.
  progress_hook._tick()  # The first finished steps start the clock.
  assert not lines
  gate.ready = True
  progress_hook._tick()
  progress_hook.on_end(loop)
  (done, num_steps, *_), = lines
  assert (done, num_steps) == (4, 8)


def test_the_epoch_speed_is_timed_from_the_end_of_its_first_step_not_its_dispatch():
  state, train_step = create(model='mlp')
  loop = hooks.Loop(state, steps_per_epoch=4, num_steps=8)
  loop.train(train_step, random_batch())
  # The first step, still running when its hooks run: a step that takes a fraction of a
  # second (compiled beforehand, so that the call only dispatches it).
  slow_step = jax.jit(lambda a: jnp.sum(jax.lax.fori_loop(0, 300, lambda _, b: b @ a / 512, a)))
  a = jnp.ones((512, 512))
  slow_step(a).block_until_ready()
  loop.dispatched = slow_step(a)
  assert not loop.dispatched.is_ready()
  hooks.TrainMetrics(None, None, None, every_steps=100, batch_size=8).after_step(loop)
  assert loop.dispatched.is_ready()  # The clock started when the step had ended.


def test_a_training_step_that_does_not_fit_names_the_batch_size():
  def update(state, batch):  # Raised where running a compiled step raises it.
    raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 6442450944 '
                                     'bytes.')
  train_step = state_lib.TrainStep(update)
  state, _ = create(model='mlp')
  loop = hooks.Loop(state, steps_per_epoch=4, num_steps=8)
  with pytest.raises(errors.OutOfMemory) as error:
    hooks.run(loop, hooks.Hooks([], hooks.Checkpointing(None, 0, None)), [random_batch()],
              train_step, lambda batch: batch, 32)
  assert (error.value.key, error.value.value) == ('batch_size', 32)
  assert '6442450944 bytes' in str(error.value)


def test_an_eval_step_that_does_not_fit_names_the_eval_batch_size(monkeypatch):
  run = run_spec.resolve(default.get_config())
  eval_ = run.evaluation('eval')
  def eval_step(model, states, batch):
    raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes.')
  monkeypatch.setattr(eval_, '_eval_step', eval_step)
  state, _ = create(model='mlp')
  batch = {**random_batch(16), 'mask': np.ones(16, bool)}
  with pytest.raises(errors.OutOfMemory) as error:
    eval_.run(state.model, [batch], INFO, num_examples=16)
  assert (error.value.key, error.value.value) == ('eval_batch_size', 16)


def test_an_epoch_is_saved_with_its_metrics_and_a_failed_evaluation_loses_no_training(tmp_path):
  state, train_step = create(model='mlp')
  checkpoints = checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy', True, max_to_keep=1)

  class Evaluate(hooks.Hook):
    evaluates = True
    def __init__(self, accuracies):
      self.accuracies = accuracies
    def after_step(self, loop):
      if loop.end_of_epoch:
        if (accuracy := self.accuracies[loop.epoch - 1]) is None:
          raise RuntimeError('evaluation failed')
        # The epoch's checkpoint is saved after its evaluation, with its metrics.
        assert loop.step not in checkpoints.all_steps()
        loop.metrics['eval/accuracy'] = accuracy

  loop = hooks.Loop(state, steps_per_epoch=1, num_steps=3)
  run_hooks = hooks.Hooks([Evaluate([0.9, 0.5, None])],
                          hooks.Checkpointing(checkpoints, 0, None))
  with pytest.raises(RuntimeError):
    hooks.run(loop, run_hooks, [random_batch(seed=i) for i in range(3)], train_step,
              lambda batch: batch, 32)
  # Epoch 3's evaluation failed: its training is kept; the best is epoch 1, by its metrics.
  assert checkpoints.all_steps() == [1, 3]
  assert checkpoints.best_step() == 1
  assert checkpointing.Checkpoints(str(tmp_path), 'eval/accuracy').best_step() == 1
  assert checkpoints.latest_progress()['epoch'] == 3
  checkpoints.close()


@pytest.mark.parametrize('batch_size,eval_batch_size,expected', [
    (32, None, 128), (500, None, 1000), (32, 48, 48)])
def test_eval_batch_is_sized_from_the_training_batch_unless_given(batch_size, eval_batch_size,
                                                                  expected):
  config = default.get_config()
  config.batch_size, config.eval_batch_size = batch_size, eval_batch_size
  assert run_spec.resolve(config).eval_batch_size == expected


def test_a_convolution_whose_patches_exceed_the_limit_runs_as_the_stock_layer(monkeypatch):
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 4))
  fast = cpu.Conv(4, 4, kernel_size=(3, 3), rngs=nnx.Rngs(0))
  stock = nnx.Conv(4, 4, kernel_size=(3, 3), rngs=nnx.Rngs(0))
  loss = lambda conv, x: jnp.sin(conv(x)).sum()
  assert cpu.patches_bytes(x.shape, fast.kernel.shape, x.dtype) == 2 * 8 * 8 * 9 * 4 * 4
  assert 'custom_vjp' in str(jax.make_jaxpr(lambda x: fast(x))(x))
  monkeypatch.setattr(cpu, 'PATCHES_LIMIT_BYTES',
                      cpu.patches_bytes(x.shape, fast.kernel.shape, x.dtype) - 1)
  assert 'custom_vjp' not in str(jax.make_jaxpr(lambda x: fast(x))(x))
  for grad, stock_grad in zip(jax.tree.leaves(nnx.grad(loss, argnums=(0, 1))(fast, x)),
                              jax.tree.leaves(nnx.grad(loss, argnums=(0, 1))(stock, x))):
    np.testing.assert_allclose(grad, stock_grad, rtol=1e-5, atol=1e-4)

"""Train and eval steps: learning, compiling ahead, masked evaluation, optimizers, schedules."""

import concurrent.futures
import types

from flax import nnx
import jax
import numpy as np
import optax
import pytest

from configs import default
from data_sources import base
from data_sources import tfds_source
import evaluators
import input_pipeline
import preprocessing
from tests.helpers.build import INFO
from tests.helpers.build import create
from tests.helpers.build import random_batch
import train
from training import evaluation
from training import hooks
from training import optimizers
from training import parallel
from training import run_spec
from training import state as state_lib

NO_OPS = preprocessing.parse('')  # Pixels scaled to [0, 1], nothing else.


def key_data(x):
  return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _loss_without_dropout(model, batch):
  model.set_attributes(deterministic=True)  # BatchNorm still normalises with batch statistics.
  logits = model(batch['image'])
  model.set_attributes(deterministic=False)
  return float(optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean())


def test_compiled_creation_equals_eager_creation():
  config = default.get_config()
  state, _ = create()
  eager_model = run_spec.resolve(config).model.build((28, 28, 1), 10, nnx.Rngs(config.seed))
  # XLA's lowest optimisation level may round the initialisers' float maths differently.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(key_data(a), key_data(b), rtol=1e-6,
                                                       atol=1e-7),
               nnx.state(state.model), nnx.state(eager_model))


def _eval_batches(split, batch_size):
  return input_pipeline.eval_batches(input_pipeline.InMemory(split.images, split.labels),
                                     batch_size)


def _compiles() -> list[str]:
  """A list that gets an entry at every XLA compilation from now on in this process."""
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kwargs: compiles.append(event)
      if event == '/jax/core/compile/backend_compile_duration' else None)
  return compiles


def test_steps_compiled_ahead_are_reused_and_change_nothing():
  compiles = _compiles()
  mesh = parallel.create_mesh()
  rng = np.random.default_rng(1)
  split = base.Split(images=rng.integers(0, 256, (70, 28, 28, 1), dtype=np.uint8),
                     labels=rng.integers(0, 10, 70).astype(np.int32))
  results = []
  with jax.set_mesh(mesh):
    eval_batches = [parallel.shard(batch, mesh) for batch in _eval_batches(split, 40)]
    for compile_ahead in (True, False):
      # Sizes no other test uses, so that no earlier compile is in the cache.
      state, train_step = create(batch_size=24)
      split_eval = evaluation.Evaluation('eval', 'test', evaluators.create('loss|accuracy'), NO_OPS)
      batch = parallel.shard(random_batch(24), mesh)
      if compile_ahead:
        compiles.clear()
        train_step.lower(state, parallel.abstract_batch(
            {'image': ((24, 28, 28, 1), np.float32), 'label': ((24,), np.int32)}, mesh)).compile()
        split_eval.compile(state.eval_model(), parallel.abstract_batch(
            {'image': ((40, 28, 28, 1), np.float32), 'label': ((40,), np.int32),
             'mask': ((40,), np.bool_)}, mesh), INFO)
        assert len(compiles) >= 2  # The train step and the eval step.
        compiles.clear()
      train_step(state, batch)
      result = split_eval.run(state.eval_model(), eval_batches, INFO)
      if compile_ahead:
        assert compiles.count('/jax/core/compile/backend_compile_duration') <= 1, compiles
      results.append((nnx.state(state), result.scalars))
  (ahead, ahead_scalars), (plain, plain_scalars) = results
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(key_data, ahead),
               jax.tree.map(key_data, plain))
  assert ahead_scalars == plain_scalars


def test_the_loops_steps_update_the_state_as_nnx_jit_updates_it_in_place():
  # The loop steps the state's arrays through its own program and writes them back when a hook
  # reads the state; a hook's change (here the metric window's reset) reaches the next step.
  stepped, train_step = create(ema_decay=0.9)  # Dropout's random streams advance, the EMA too.
  in_place, _ = create(ema_decay=0.9)
  update_in_place = nnx.jit(train_step.update)
  loop = hooks.Loop(stepped, steps_per_epoch=2, num_steps=4)
  for seed in range(4):
    loop.train(train_step, random_batch(seed=seed))
    update_in_place(in_place, random_batch(seed=seed))
    if seed == 1:
      loop.state.window.reset()
      in_place.window.reset()
  assert int(loop.state.window.count[...]) == 64 and int(loop.dispatched) == 4
  jax.tree.map(_assert_equal, nnx.state(loop.state), nnx.state(in_place))


def _assert_equal(a: jax.Array, b: jax.Array) -> None:
  if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # The random streams' keys.
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  np.testing.assert_array_equal(a, b)


def test_steps_compiled_in_a_thread_for_the_planned_state_serve_the_built_state():
  # As train.py starts: the steps compile for the state's structure in a thread while the
  # state is built; the loop's first step must reuse that executable, not compile again.
  compiles = _compiles()
  config = default.get_config()
  config.batch_size = 26  # A size no other test compiles for.
  run = run_spec.resolve(config)
  mesh = parallel.create_mesh()
  session = types.SimpleNamespace(run=run, data=types.SimpleNamespace(info=INFO), mesh=mesh,
                                  eval_batch_size=40)
  with jax.set_mesh(mesh):
    planned = state_lib.plan(run.model, INFO, run.optimization,
                             run.optimization.learning_rate_schedule(100), seed=run.seed)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
      compiling = thread.submit(train._compile, session, planned.abstract, lambda: None)
      state = planned.build()
      train_step = compiling.result()
    compiles.clear()
    batch = parallel.shard({'image': np.zeros((26, 28, 28, 1), np.uint8),
                            'label': np.zeros(26, np.int32)}, mesh)
    stepper = state_lib.Stepper(train_step, state)  # As the training loop steps it.
    stepper(batch)
  assert '/jax/core/compile/backend_compile_duration' not in compiles, compiles
  assert int(stepper.sync().window.count[...]) == 26


def test_train_step_lowers_loss_on_a_fixed_batch(tfds_data_dir):
  split = tfds_source.TfdsSource('mnist', tfds_data_dir).load_split('train[:128]')
  batch = {'image': split.images.astype(np.float32) / 255, 'label': split.labels}
  state, train_step = create()
  before = _loss_without_dropout(state.model, batch)
  train_step(state, batch)
  after = _loss_without_dropout(state.model, batch)
  assert after < before - 0.1, (before, after)
  assert state.window.results()['train/accuracy'] == state.epoch.results()['train/accuracy']
  assert int(state.window.count[...]) == 128


def test_masked_padded_eval_equals_eval_of_real_examples_only():
  state, _ = create()
  rng = np.random.default_rng(0)
  split = base.Split(images=rng.integers(0, 256, (250, 28, 28, 1), dtype=np.uint8),
                     labels=rng.integers(0, 10, 250).astype(np.int32))
  split_eval = evaluation.Evaluation('eval', 'test', evaluators.create('loss|accuracy|per_class'),
                                     NO_OPS)
  padded = split_eval.run(state.eval_model(), _eval_batches(split, 100), INFO)
  exact = split_eval.run(state.eval_model(), _eval_batches(split, 250), INFO)
  assert padded.scalars.keys() == exact.scalars.keys()
  for name, value in exact.scalars.items():
    assert padded.scalars[name] == pytest.approx(value, rel=1e-5), name
  assert padded.per_class['support'].sum() == 250


def test_evaluate_restores_train_mode():
  state, _ = create()
  split = base.Split(images=np.zeros((10, 28, 28, 1), np.uint8), labels=np.zeros(10, np.int32))
  evaluation.Evaluation('eval', 'test', evaluators.create('accuracy'), NO_OPS).run(
      state.eval_model(), _eval_batches(split, 10), INFO)
  model = state.model
  assert not model.dropout1.deterministic and not model.batch_norm1.use_running_average


@pytest.mark.parametrize('name', optimizers.OPTIMIZERS.names())
def test_every_optimizer_trains(name):
  state, train_step = create(optimizer=name, learning_rate=0.1 if name == 'sgd' else 1e-3)
  model = state.model
  kernels = lambda: [np.array(layer.kernel[...]) for layer in
                     (model.conv1, model.conv2, model.linear1, model.linear2)]
  before = kernels()
  train_step(state, random_batch())
  for old, new in zip(before, kernels()):
    assert not np.allclose(old, new)


def test_schedules_and_warmup():
  config = default.get_config()
  config.update(num_epochs=10, learning_rate=0.5, warmup_epochs=1.0)
  steps_per_epoch = 10
  for name, start, peak_step, end in (('constant', 0.0, 10, 0.5), ('cosine', 0.0, 10, 0.0)):
    config.schedule = name
    schedule = run_spec.resolve(config).optimization.learning_rate_schedule(steps_per_epoch)
    assert float(schedule(0)) == pytest.approx(start), name  # Warming up from 0.
    assert float(schedule(5)) == pytest.approx(0.25), name  # Linearly.
    assert float(schedule(peak_step)) == pytest.approx(0.5), name
    assert float(schedule(100)) == pytest.approx(end, abs=1e-6), name
  config.update(schedule='cosine', warmup_epochs=0.0)
  schedule = run_spec.resolve(config).optimization.learning_rate_schedule(steps_per_epoch)
  assert float(schedule(0)) == pytest.approx(0.5)
  assert float(schedule(50)) == pytest.approx(0.25)  # Half way down the half cosine.

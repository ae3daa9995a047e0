"""Where one train step's time goes: a profile of the compiled step, by operation.

    python -m benchmarks.step_profile --config=configs/default.py --steps=50
    python -m benchmarks.step_profile --config=configs/finetune.py --config.model=resnet50 \
      --image_shape=224,224,3 --num_classes=1000 --warmup=2 --steps=2 --repeats=2

Builds the state and train step of `config` as training does (same model, layers, optimizer
and loss; random batches of --image_shape, MNIST's by default, which cost what real ones do),
runs warm-up steps, then traces --steps steps with `jax.profiler` and reads the trace (an
XPlane protobuf, parsed with TensorFlow's copy of its schema). XLA:CPU records one event per
operation it runs (a fusion, a matmul, a copy...). Each row is one operation of the compiled
step: milliseconds per step, its share of the step's wall time, its output shape, the pass
(forward, or backward: JAX's `transpose(jvp(...))`), the Python function that traced it (from
the HLO's stack frames) and, for matmuls, the GFLOP/s they reach against a 2048x2048 matmul's
in the same process. --json writes the step times and every operation (`harness.write_json`).

On an accelerator, the trace describes each operation itself (XLA:TPU's 'XLA Ops' line: its
shape, FLOPs, JAX name and Python source line), and the rows are read from it. A trace kept with
--keep_trace is read again, without running anything, by --trace:

    python -m benchmarks.step_profile --trace=vit_small.xplane.pb --rows=30
"""

import collections
import glob
import os
import re
import shutil
import tempfile

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

runtime.start()

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from benchmarks import harness  # pylint: disable=g-import-not-at-top
from benchmarks import hlo  # pylint: disable=g-import-not-at-top
from data_sources import base  # pylint: disable=g-import-not-at-top
from training import run_spec  # pylint: disable=g-import-not-at-top
from training import state as state_lib  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config whose step to profile.')
flags.DEFINE_integer('steps', 50, 'Steps traced.', lower_bound=1)
flags.DEFINE_integer('warmup', 20, 'Steps run before tracing.', lower_bound=1)
flags.DEFINE_integer('rows', 15, 'Operations listed, the slowest first.', lower_bound=1)
flags.DEFINE_integer('repeats', 5, 'Untraced timings of --steps steps (min and median shown).',
                     lower_bound=1)
flags.DEFINE_list('image_shape', ['28', '28', '1'], "The batches' images: height, width, channels.")
flags.DEFINE_integer('num_classes', 10, 'Classes of the head.', lower_bound=2)
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
flags.DEFINE_string('trace', None, 'Read this kept trace (--keep_trace) instead of running '
                    "a step: its accelerator's operations.")
flags.DEFINE_string('keep_trace', None, "Where to copy the trace's XPlane file (optional), for "
                    'TensorBoard or a second look.')

def print_by_function(rows: list[tuple[float, str, hlo.Operation]], step_ms: float) -> None:
  """The same operations summed by the function that traced them, pass and kind (a matmul, or
  a fusion or copy without one): where a large step's time goes, which its many small
  operations hide from the table by operation."""
  groups = collections.defaultdict(lambda: [0.0, 0, 0.0])
  for ms, _, operation in rows:
    group = groups[(operation.traced_by, operation.backward, bool(operation.flops))]
    group[0] += ms
    group[1] += 1
    group[2] += operation.flops
  print(harness.markdown_table(
      ['traced by', 'pass', 'kind', 'operations', 'ms per step', 'share', 'GFLOP/s'],
      [[traced_by, 'backward' if backward else 'forward', 'matmul' if matmul else 'other', count,
        f'{ms:.1f}', f'{ms / step_ms:.1%}', f'{flops / ms / 1e6:.0f}' if flops else '']
       for (traced_by, backward, matmul), (ms, count, flops) in sorted(
           groups.items(), key=lambda item: -item[1][0])[:FLAGS.rows]], align='lllrrrr'))


def profile(config) -> tuple[object, list[tuple[float, str, hlo.Operation]], str, dict]:
  """Builds `config`'s state and train step, times and traces it: the trace, its operations,
  a line saying what was run and how long its steps took, and those figures for --json."""
  run = run_spec.resolve(config)
  info = base.DatasetInfo('random', tuple(int(n) for n in FLAGS.image_shape), FLAGS.num_classes,
                          60_000, 10_000)
  schedule = run.optimization.learning_rate_schedule(60_000 // config.batch_size)
  state = state_lib.create(run.model, info, run.optimization, schedule, seed=run.seed,
                           ema_decay=run.ema_decay)
  train_step = state_lib.make_train_step(run.loss(info.num_classes), run.input.preprocess)
  rng = np.random.default_rng(0)
  shape = (config.batch_size, *info.image_shape)

  def images():  # What training's batches hold (uint8 unless a random op computes pixels).
    if run.input.image_dtype == np.uint8:
      return rng.integers(0, 256, shape, np.uint8)
    return rng.random(shape, np.float32)

  batches = [{'image': jnp.asarray(images()),
              'label': jnp.asarray(rng.integers(0, FLAGS.num_classes, config.batch_size, np.int32))}
             for _ in range(4)]
  operations = hlo.operations(train_step.lower(state, batches[0]).compile().as_text())

  stepper = state_lib.Stepper(train_step, state)  # As the training loop steps it.

  def run_steps(count: int) -> None:
    """`count` steps, dispatched ahead as training does, and waited for."""
    jax.block_until_ready([stepper(batches[i % 4]) for i in range(count)][-1])

  def ms_per_step(repeats: int) -> list[float]:
    """Milliseconds per step of --steps steps, `repeats` times, the fastest first."""
    return sorted(seconds / FLAGS.steps * 1000 for seconds in
                  harness.time_calls(lambda: run_steps(FLAGS.steps), repeats))

  run_steps(FLAGS.warmup)
  untraced = ms_per_step(FLAGS.repeats)
  # Host events only: Python's tracer would slow the dispatching thread.
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, profiler_options=options):
      step_ms, = ms_per_step(1)
    space = hlo.read_trace(trace_dir)
    if FLAGS.keep_trace:
      shutil.copy(*glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True),
                  FLAGS.keep_trace)
  rows = hlo.device_operations(space, FLAGS.steps) or sorted(
      ((picoseconds / 1e9 / FLAGS.steps, name, operations[name])
       for name, picoseconds in hlo.host_events(space).items() if name in operations),
      reverse=True)
  peak = harness.matmul_flops_per_sec() / 1e9
  summary = (f'{config.model}, batch {config.batch_size}, kernels={config.kernels}, '
             f'{config.compute_dtype}, images {info.image_shape}: {untraced[0]:.1f} ms per step '
             f'untraced (min of {FLAGS.repeats} x {FLAGS.steps}; median '
             f'{untraced[len(untraced) // 2]:.1f}), {step_ms:.1f} ms traced; 2048x2048 matmul '
             f'{peak:.0f} GFLOP/s')
  return space, rows, summary, {
      'model': config.model, 'batch_size': config.batch_size, 'image_shape': info.image_shape,
      'untraced_ms_per_step': untraced, 'traced_ms_per_step': step_ms,
      'matmul_peak_gflops': peak}


def main(argv):
  del argv
  if FLAGS.trace:  # A trace kept before (--keep_trace): its accelerator's operations.
    space = hlo.read_trace(FLAGS.trace)
    steps = hlo.traced_steps(space) or FLAGS.steps
    rows = hlo.device_operations(space, steps)
    step_ms = sum(row[0] for row in rows)
    summary, figures = (f'{FLAGS.trace}: {steps} steps, {step_ms:.1f} ms of device time a step',
                        {'trace': FLAGS.trace, 'steps': steps, 'device_ms_per_step': step_ms})
  else:
    space, rows, summary, figures = profile(FLAGS.config)
    step_ms = figures['traced_ms_per_step']
  print(f'{summary}, {sum(row[0] for row in rows):.1f} ms in {len(rows)} XLA operations')
  rest = sum(row[0] for row in rows[FLAGS.rows:])
  print(harness.markdown_table(
      ['operation', 'ms per step', 'share', 'output', 'pass', 'traced by', 'GFLOP/s'],
      [*([name, f'{ms:.2f}', f'{ms / step_ms:.1%}', operation.shape,
          'backward' if operation.backward else 'forward', operation.traced_by,
          f'{operation.flops / ms / 1e6:.0f}' if operation.flops else '']
         for ms, name, operation in rows[:FLAGS.rows]),
       [f'{len(rows) - FLAGS.rows} more', f'{rest:.2f}', f'{rest / step_ms:.1%}', '', '', '', '']],
      align='lrrlllr'))
  print_by_function(rows, step_ms)
  matmul_ms = sum(ms for ms, _, operation in rows if operation.flops)
  matmul_flops = sum(operation.flops for _, _, operation in rows if operation.flops)
  if matmul_ms:
    print(f'Matmuls: {matmul_ms:.1f} ms per step ({matmul_ms / step_ms:.0%}), '
          f'{matmul_flops / matmul_ms / 1e6:.0f} GFLOP/s; everything else '
          f'{step_ms - matmul_ms:.1f} ms.')
  if not rows:  # The trace names its events otherwise: its busiest names, to match them.
    print('No traced event matched an operation of the step; the most time went to',
          hlo.host_events(space).most_common(10))
  if FLAGS.json:
    harness.write_json(FLAGS.json, {
        **figures,
        'operations': [{'name': name, 'ms_per_step': ms, **operation._asdict()}
                       for ms, name, operation in rows]})


if __name__ == '__main__':
  app.run(main)

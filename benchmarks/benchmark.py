"""Measures training speed on real MNIST: this project's train step and, beside it, the reference.

    python -m benchmarks.benchmark --config=configs/default.py --reference --stock_layers

Each measurement runs in a fresh child process, set up as its program runs by itself: the
project as `main.py` does (with its malloc setting on CPU), the reference (the official Flax NNX
MNIST example's loop, `benchmarks/reference_mnist.py`) as published. With --reference, another
child runs the reference with the project's malloc setting, to show what that setting alone
gives it; with --stock_layers, another runs the project with config.kernels='stock'.
The children alternate for --rounds rounds, so that a machine's speed drifting over the run
(shared cloud cores do) hits all of them alike; the table shows each figure's median.

A child measures compile time, XLA's FLOPs per example, steady-state training examples/s,
where a step's time goes (waiting for input / Python dispatch / device compute, each timed with
a sync after every step), eval examples/s, a 2048x2048 matmul's FLOP/s and its peak RSS.
--time_to_accuracy also trains `main.py` and the reference for real, each timed from process
start to the first epoch whose eval accuracy reaches --target_accuracy. --whole_runs=N trains
config.num_epochs N times each, alternating, each a whole process timed from spawn to exit with
a new, empty compilation cache, with its last eval accuracy (the reference's on the 9,984
images of its drop_remainder batches). Prints a table; --json keeps every round.
"""

import sys

from core import runtime  # pylint: disable=g-bad-import-order  (first: it must precede tensorflow)

# As main.py does, before TensorFlow and JAX start their threads (only where asked to, so that
# the reference can also be measured as published).
if '--keep_freed_memory' in sys.argv:
  runtime.tune_malloc_for_cpu()

import json
import os
import re
import resource
import tempfile
import time
from collections.abc import Callable, Iterator

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
from ml_collections import config_flags
import numpy as np
import tensorflow as tf

from benchmarks import harness
from benchmarks import reference_mnist
import input_pipeline
from training import parallel
from training import run_spec
from training import state as state_lib

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to benchmark.')
flags.DEFINE_integer('steps', 100, 'Training steps timed for throughput and for the breakdown.')
flags.DEFINE_integer('rounds', 3, 'Alternating rounds of measurements; figures are medians '
                     '(0: none, for --whole_runs alone).', lower_bound=0)
flags.DEFINE_bool('reference', False, 'Also measure the reference example, side by side.')
flags.DEFINE_bool('stock_layers', False,
                  "Also measure the project with config.kernels='stock' (flax's stock layers).")
flags.DEFINE_bool('time_to_accuracy', False, 'Also train for real until --target_accuracy.')
flags.DEFINE_float('target_accuracy', 0.99, 'Eval accuracy that ends a time-to-accuracy run.')
flags.DEFINE_integer('whole_runs', 0, "Also train config.num_epochs for real this many times, "
                     'alternating the programs, each a whole process timed from spawn to exit.',
                     lower_bound=0)
flags.DEFINE_string('logs', None, 'A folder for the output of every whole run (optional).')
flags.DEFINE_integer('matmul_size', harness.MATMUL_SIZE, 'Side of the square matmul whose '
                     'FLOP/s is the peak (small: quick checks).', lower_bound=1)
flags.DEFINE_string('json', 'benchmark.json', 'Where to write the figures.')
# Internal: what a child process measures, and whether it sets up malloc as main.py does.
flags.DEFINE_enum('measure', None, ['project', 'reference'], 'Measure one program, in-process.')
flags.DEFINE_bool('keep_freed_memory', False, "Set malloc up as main.py does on CPU.")

# Child runs: (name in the table, program measured, with the project's malloc setting, extra
# flags).
_PROJECT = ('project', 'project', True, ())
_STOCK_LAYERS = ('project_stock_layers', 'project', True, ('--config.kernels=stock',))
_REFERENCE_RUNS = [('reference', 'reference', False, ()),
                   ('reference_kept_memory', 'reference', True, ())]


def measure_training(step: Callable[[dict], object], batches: Iterator[dict],
                     examples_per_call: int, num_calls: int) -> dict[str, float]:
  """Throughput of `step` over `batches` and the split of one train step's time.

  Throughput runs asynchronously, as training does. The breakdown then syncs after every call:
  input = waiting for the next batch, dispatch = until `step` returns, compute = until the
  device is done.
  """
  jax.block_until_ready(step(next(batches)))  # Warm: compiled and pipeline running.
  start = time.perf_counter()
  for _ in range(num_calls):
    out = step(next(batches))
  jax.block_until_ready(out)
  elapsed = time.perf_counter() - start
  split = np.zeros(3)
  for _ in range(num_calls):
    t0 = time.perf_counter()
    batch = next(batches)
    t1 = time.perf_counter()
    out = step(batch)
    t2 = time.perf_counter()
    jax.block_until_ready(out)
    split += [t1 - t0, t2 - t1, time.perf_counter() - t2]
  split_ms = split / num_calls * 1000 / (examples_per_call / FLAGS.config.batch_size)
  return {'train_examples_per_sec': num_calls * examples_per_call / elapsed,
          'step_ms_input_wait': split_ms[0], 'step_ms_dispatch': split_ms[1],
          'step_ms_compute': split_ms[2], 'input_wait_share': split[0] / split.sum()}


def flops_per_example(jitted, *args, examples: int) -> tuple[float, float]:
  """(compile seconds, XLA cost-analysis FLOPs per example) of `jitted(*args)`."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return seconds, float(cost['flops']) / examples


def _open_splits(run: run_spec.Run, data: input_pipeline.Data, mesh: jax.sharding.Mesh):
  """This process's training split and the eval split's sharded batches, opened as `train`
  opens them (its helpers are private: the same public input_pipeline calls, here)."""
  train_split = input_pipeline.open_split(
      data, input_pipeline.process_split(run.input.train_split, drop_remainder=True), run.input)
  if not isinstance(train_split, input_pipeline.Streamed):
    input_pipeline.log_class_counts(train_split.labels, data.info.class_names,
                                    run.input.train_split)
  evaluating = run.evaluation('eval')
  eval_batches = input_pipeline.open_eval_batches(
      data, run.input, evaluating.split, data.eval_sizes[evaluating.name],
      parallel.round_up(run.eval_batch_size, mesh), evaluating.preprocess,
      place=lambda batch: parallel.shard(batch, mesh))
  return train_split, eval_batches


def measure_project(config) -> dict[str, float]:
  """The project's figures, through the same data, state, step and evaluation code as `train`."""
  run = run_spec.resolve(config)
  mesh = parallel.create_mesh()
  jax.set_mesh(mesh)
  data = input_pipeline.open_data(run.input, run.eval_splits())
  train_split, eval_batches = _open_splits(run, data, mesh)
  schedule = run.optimization.learning_rate_schedule(
      data.info.num_train_examples // run.batch_size)
  state = state_lib.create(run.model, data.info, run.optimization, schedule, seed=run.seed,
                           ema_decay=run.ema_decay)
  train_step = state_lib.make_train_step(run.loss(data.info.num_classes),
                                         run.input.preprocess)
  batches = (parallel.shard(batch, mesh)
             for batch in input_pipeline.read_ahead(input_pipeline.train_batches(
                 train_split, data, run.input, run.batch_size)))
  first = next(batches)
  compile_s, flops = flops_per_example(train_step, state, first, examples=run.batch_size)

  step = state_lib.Stepper(train_step, state)  # As the training loop steps it; what it
  # returns is ready when the step's program is done.

  results = measure_training(step, batches, run.batch_size, FLAGS.steps)
  state = step.sync()
  split = run.evaluation('eval')
  split.run(state.eval_model(), eval_batches, data.info)  # Compile.
  eval_s = harness.best_seconds(lambda: split.run(state.eval_model(), eval_batches, data.info),
                                repeats=3)
  return {'compile_s': compile_s, 'flops_per_example': flops, **results,
          'eval_examples_per_sec': data.eval_sizes['eval'] / eval_s}


def measure_reference(config) -> dict[str, float]:
  # Evaluated on the project's eval split (the whole test split, unless set otherwise).
  train_ds, test_ds = reference_mnist.datasets(config.data_dir, test_split=config.eval_split)
  model, optimizer, metrics = reference_mnist.create()
  batches = train_ds.repeat().as_numpy_iterator()
  first = next(batches)
  compile_s, flops = flops_per_example(reference_mnist.train_step, model, optimizer,
                                       metrics, first, examples=len(first['label']))

  def step(batch):
    reference_mnist.train_step(model, optimizer, metrics, batch)
    return nnx.state(model)

  results = measure_training(step, batches, len(first['label']), FLAGS.steps)
  reference_mnist.evaluate(model, metrics, test_ds)  # Compile.
  eval_s = harness.best_seconds(lambda: reference_mnist.evaluate(model, metrics, test_ds),
                                repeats=3)
  num_eval = sum(len(batch['label']) for batch in test_ds.as_numpy_iterator())
  return {'compile_s': compile_s, 'flops_per_example': flops, **results,
          'eval_examples_per_sec': num_eval / eval_s}


def measure(program: str) -> dict[str, float]:
  """All in-process figures of `program` ('project' or 'reference')."""
  config = FLAGS.config
  peak = harness.matmul_flops_per_sec(size=FLAGS.matmul_size)
  figures = (measure_project if program == 'project' else measure_reference)(config)
  achieved = figures['flops_per_example'] * figures['train_examples_per_sec']
  return {**figures, 'matmul_gflops': peak / 1e9, 'achieved_gflops': achieved / 1e9,
          'fraction_of_matmul_peak': achieved / peak,
          'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_in_child(program: str, keep_freed_memory: bool,
                     extra_flags: tuple[str, ...]) -> dict[str, float]:
  """`measure(program)` in a fresh process, with this process's flags and `extra_flags`."""
  flags_passed = [arg for arg in sys.argv[1:] if not arg.startswith('--json')]
  figures, _ = harness.json_child(
      [sys.executable, '-m', 'benchmarks.benchmark', *flags_passed, *extra_flags,
       f'--measure={program}'] + (['--keep_freed_memory'] if keep_freed_memory else []))
  return figures


def timed_training(command: list[str], pattern: str, target: float | None,
                   log_path: str | None = None) -> dict[str, float]:
  """Runs `command`, a training process printing its eval accuracy at every epoch, until the
  accuracy reaches `target` (then stopped) or, with `target` None, to its end; times from
  its spawn.

  `pattern` finds (epoch, accuracy) in the child's output lines.
  """
  start = time.perf_counter()
  result = {'seconds_to_target': float('nan'), 'epochs_to_target': float('nan')}

  def reached(line: str) -> bool:
    if not (match := re.search(pattern, line)):
      return False
    epoch, accuracy = int(match.group(1)), float(match.group(2))
    logging.info('epoch %d, eval_accuracy %.4f at %.1fs', epoch, accuracy,
                 time.perf_counter() - start)
    result.update(last_epoch=epoch, last_eval_accuracy=accuracy)
    if target is None or accuracy < target:
      return False
    result.update(seconds_to_target=time.perf_counter() - start, epochs_to_target=epoch)
    return True

  child = harness.run_child(command, stop=reached, log_path=log_path)
  if target is None:
    return {'process_seconds': child.seconds, 'eval_accuracy': result['last_eval_accuracy'],
            'epochs': result['last_epoch'], 'peak_rss_mb': child.peak_rss_mb}
  return {'seconds_to_target': result['seconds_to_target'],
          'epochs_to_target': result['epochs_to_target'],
          'peak_rss_mb_training': child.peak_rss_mb}


def training_commands(config, workdir: str) -> dict[str, tuple[list[str], str]]:
  """The command line of each program trained for real (`main.py` with this run's config
  overrides, in `workdir`; with --reference, the reference for config.num_epochs), with the
  pattern of its per-epoch accuracy lines."""
  overrides = [arg for arg in sys.argv[1:] if arg.startswith('--config.')]  # As for the others.
  commands = {'project': (
      [sys.executable, 'main.py', f'--config={FLAGS["config"].config_filename}',
       f'--workdir={workdir}', *overrides], r'epoch (\d+)/\d+: .*eval/accuracy=([0-9.]+)')}
  if FLAGS.reference:
    data_dir = [f'--data_dir={config.data_dir}'] if config.data_dir else []
    commands['reference'] = (
        [sys.executable, '-m', 'benchmarks.reference_mnist', *data_dir,
         f'--num_epochs={config.num_epochs}'], r'epoch (\d+) eval_accuracy ([0-9.]+)')
  return commands


def time_to_accuracy_runs(config) -> dict[str, dict[str, float]]:
  with tempfile.TemporaryDirectory() as workdir:
    return {name: timed_training(command, pattern, FLAGS.target_accuracy)
            for name, (command, pattern) in training_commands(config, workdir).items()}


def whole_runs(config) -> dict[str, list[dict[str, float]]]:
  """--whole_runs rounds of every program trained for config.num_epochs, alternating; each
  run of the project in a new workdir, with a new, empty compilation cache (`run_child`)."""
  runs = {}
  if FLAGS.logs:
    os.makedirs(FLAGS.logs, exist_ok=True)
  for round_index in range(FLAGS.whole_runs):
    with tempfile.TemporaryDirectory() as workdir:
      for name, (command, pattern) in training_commands(config, workdir).items():
        log_path = FLAGS.logs and os.path.join(FLAGS.logs, f'{name}_{round_index + 1}.log')
        runs.setdefault(name, []).append(timed_training(command, pattern, None, log_path))
        logging.info('whole run of %s: %.1f s, eval accuracy %.4f', name,
                     runs[name][-1]['process_seconds'], runs[name][-1]['eval_accuracy'])
  return runs


def main(argv):
  del argv
  tf.config.set_visible_devices([], 'GPU')
  if FLAGS.measure:
    with open(FLAGS.json, 'w') as f:
      json.dump(measure(FLAGS.measure), f)
    return

  children = ([_PROJECT] + ([_STOCK_LAYERS] if FLAGS.stock_layers else [])
              + (_REFERENCE_RUNS if FLAGS.reference else []))
  rounds = {name: [] for name, *_ in children}
  for round_index in range(FLAGS.rounds):
    for name, program, keep_freed_memory, extra_flags in children:
      rounds[name].append(measure_in_child(program, keep_freed_memory, extra_flags))
      logging.info('round %d %s: %.0f training examples/s', round_index + 1, name,
                   rounds[name][-1]['train_examples_per_sec'])
  runs = {name: {key: harness.median([figures[key] for figures in measured])
                 for key in measured[0]} for name, measured in rounds.items() if measured}
  if FLAGS.time_to_accuracy:
    for name, figures in time_to_accuracy_runs(FLAGS.config).items():
      runs.setdefault(name, {}).update(figures)
  trained = whole_runs(FLAGS.config) if FLAGS.whole_runs else {}
  for name, measured in trained.items():
    runs.setdefault(name, {}).update({f'whole_run_{key}': harness.median([figures[key] for figures in measured])
                       for key in measured[0]})

  report = {'device': str(jax.devices()[0].device_kind), 'num_devices': jax.device_count(),
            'config': str(FLAGS['config'].config_filename), 'steps': FLAGS.steps,
            'rounds': FLAGS.rounds, 'runs': runs, 'every_round': rounds,
            'whole_runs': trained}
  names = sorted({key for figures in runs.values() for key in figures})
  print('\n' + harness.markdown_table(
      [f'median of {FLAGS.rounds} rounds', *runs],
      [[key, *(f'{runs[name].get(key, float("nan")):.4g}' for name in runs)] for key in names],
      align='l' + 'r' * len(runs)))
  if FLAGS.reference and FLAGS.rounds:
    # Per round, so that drift between rounds cancels out of each ratio.
    speedups = [project['train_examples_per_sec'] / reference['train_examples_per_sec']
                for project, reference in zip(rounds['project'], rounds['reference'])]
    report['train_speedup_vs_reference'] = harness.median(speedups)
    report['train_speedup_vs_reference_every_round'] = speedups
    print(f'train speed-up vs reference: {report["train_speedup_vs_reference"]:.2f}x (median of '
          + ', '.join(f'{s:.2f}' for s in speedups) + ')')
  if FLAGS.reference and trained:
    speedups = [reference['process_seconds'] / project['process_seconds']
                for project, reference in zip(trained['project'], trained['reference'])]
    report['whole_run_speedup_vs_reference'] = harness.median(speedups)
    report['whole_run_speedup_vs_reference_every_round'] = speedups
    print(f'whole-run speed-up vs reference ({FLAGS.config.num_epochs} epochs, each process '
          f'from spawn to exit): {report["whole_run_speedup_vs_reference"]:.2f}x (median of '
          + ', '.join(f'{s:.2f}' for s in speedups) + ')')
  print(f'on {report["device"]} x{report["num_devices"]}')
  harness.write_json(FLAGS.json, report)


if __name__ == '__main__':
  app.run(main)

"""Measures training speed on real MNIST: this project's train step and, side by side, the reference.

    python benchmark.py --config=configs/default.py --reference --time_to_accuracy

In-process, for the project (the real input pipeline, model and `train.train_steps`) and, with
--reference, for the official Flax NNX MNIST example's loop (`reference_baseline.py`):
compile time, XLA's FLOPs per example, steady-state training examples/s (compile excluded),
where a step's time goes (waiting for the input pipeline / Python dispatch / device compute,
each timed with a sync after every step), eval examples/s, and achieved FLOP/s as a fraction of a
2048x2048 matmul measured in the same run. With --time_to_accuracy, each also trains for real in
a subprocess, timed from process start to the first epoch whose eval accuracy reaches
--target_accuracy (the child is stopped there), with the child's peak RSS.
Prints a table and writes everything to --json.
"""

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from absl import app
from absl import flags
from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import tensorflow as tf

import input_pipeline
import models
import optimizers
import reference_baseline
import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to benchmark.')
flags.DEFINE_integer('steps', 100, 'Training steps timed for throughput and for the breakdown.')
flags.DEFINE_bool('reference', False, 'Also measure the reference example, side by side.')
flags.DEFINE_bool('time_to_accuracy', False, 'Also train for real until --target_accuracy.')
flags.DEFINE_float('target_accuracy', 0.99, 'Eval accuracy that ends a time-to-accuracy run.')
flags.DEFINE_string('json', 'benchmark.json', 'Where to write the figures.')

_ROOT = os.path.dirname(os.path.abspath(__file__))


def best_time(fn: Callable[[], object], repeats: int = 5) -> float:
  """Seconds of the fastest of `repeats` calls of `fn` (which must block until done)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def matmul_flops_per_sec(size: int = 2048) -> float:
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  return 2 * size**3 / best_time(lambda: matmul(a).block_until_ready(), repeats=10)


def measure_training(step: Callable[[dict], object], batches: Iterator[dict],
                     examples_per_call: int, num_calls: int) -> dict[str, float]:
  """Throughput of `step` over `batches` and the split of one call's time.

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
          'step_ms_compute': split_ms[2]}


def flops_per_example(jitted, *args, examples: int) -> tuple[float, float]:
  """(compile seconds, XLA cost-analysis FLOPs per example) of `jitted(*args)`."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return seconds, float(cost['flops']) / examples


def measure_project(config) -> dict[str, float]:
  builder = input_pipeline.prepared_builder(config)
  info = input_pipeline.get_info(builder, config)
  split = input_pipeline.load_split(builder, config.train_split)
  eval_batches = input_pipeline.eval_batches(
      input_pipeline.load_split(builder, config.eval_split), config.eval_batch_size)
  model = models.create_model(config, info.image_shape, info.num_classes, nnx.Rngs(config.seed))
  schedule = optimizers.create_learning_rate_schedule(config, 1000)
  optimizer = nnx.Optimizer(model, optimizers.create_optimizer(config, schedule), wrt=nnx.Param)
  metrics = train.Metrics.empty()
  chunks = input_pipeline.train_batches(split, config)
  first = next(chunks)
  examples_per_call = first['label'].size
  compile_s, flops = flops_per_example(train.train_steps, model, optimizer, metrics, first,
                                       examples=examples_per_call)

  def step(chunk):
    nonlocal metrics
    metrics = train.train_steps(model, optimizer, metrics, chunk)
    return metrics

  results = measure_training(step, chunks, examples_per_call,
                             max(1, FLAGS.steps // config.steps_per_dispatch))
  train.evaluate(model, eval_batches)  # Compile.
  eval_s = best_time(lambda: train.evaluate(model, eval_batches), repeats=3)
  num_eval = sum(int(batch['mask'].sum()) for batch in eval_batches)
  return {'compile_s': compile_s, 'flops_per_example': flops, **results,
          'eval_examples_per_sec': num_eval / eval_s}


def measure_reference(config) -> dict[str, float]:
  train_ds, test_ds = reference_baseline.datasets(config.data_dir)
  model, optimizer, metrics = reference_baseline.create()
  batches = train_ds.repeat().as_numpy_iterator()
  first = next(batches)
  compile_s, flops = flops_per_example(reference_baseline.train_step, model, optimizer,
                                       metrics, first, examples=len(first['label']))

  def step(batch):
    reference_baseline.train_step(model, optimizer, metrics, batch)
    return nnx.state(model)

  results = measure_training(step, batches, len(first['label']), FLAGS.steps)
  reference_baseline.evaluate(model, metrics, test_ds)  # Compile.
  eval_s = best_time(lambda: reference_baseline.evaluate(model, metrics, test_ds), repeats=3)
  num_eval = sum(len(batch['label']) for batch in test_ds.as_numpy_iterator())
  return {'compile_s': compile_s, 'flops_per_example': flops, **results,
          'eval_examples_per_sec': num_eval / eval_s}


def time_to_accuracy(command: list[str], pattern: str) -> dict[str, float]:
  """Runs `command` until a printed eval accuracy reaches the target; times from its start.

  `pattern` finds (epoch, accuracy) in the child's output lines.
  """
  start = time.perf_counter()
  child = subprocess.Popen(command, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
  result = {'seconds_to_target': float('nan'), 'epochs_to_target': float('nan')}
  for line in child.stdout:
    match = re.search(pattern, line)
    if match:
      epoch, accuracy = int(match.group(1)), float(match.group(2))
      logging.info('time to accuracy: epoch %d, eval_accuracy %.4f at %.1fs', epoch, accuracy,
                   time.perf_counter() - start)
      if accuracy >= FLAGS.target_accuracy:
        result = {'seconds_to_target': time.perf_counter() - start, 'epochs_to_target': epoch}
        child.terminate()
        break
  child.stdout.close()
  _, status, usage = os.wait4(child.pid, 0)
  if np.isnan(result['seconds_to_target']) and status != 0:
    raise RuntimeError(f'{command} failed with status {status}.')
  return {**result, 'peak_rss_mb': usage.ru_maxrss / 1024}


def main(argv):
  del argv
  tf.config.set_visible_devices([], 'GPU')
  config = FLAGS.config
  peak = matmul_flops_per_sec()
  logging.info('matmul peak: %.1f GFLOP/s on %s', peak / 1e9, jax.devices())
  runs = {'project': measure_project(config)}
  if FLAGS.reference:
    runs['reference'] = measure_reference(config)
  for figures in runs.values():
    achieved = figures['flops_per_example'] * figures['train_examples_per_sec']
    figures['achieved_gflops'] = achieved / 1e9
    figures['fraction_of_matmul_peak'] = achieved / peak
  if FLAGS.time_to_accuracy:
    data_dir = [f'--config.data_dir={config.data_dir}'] if config.data_dir else []
    with tempfile.TemporaryDirectory() as workdir:
      runs['project'].update(time_to_accuracy(
          [sys.executable, 'main.py', f'--config={FLAGS["config"].config_filename}',
           f'--workdir={workdir}', *data_dir],
          r'epoch (\d+)/\d+: .*eval_accuracy=([0-9.]+)'))
    if FLAGS.reference:
      data_dir = [f'--data_dir={config.data_dir}'] if config.data_dir else []
      runs['reference'].update(time_to_accuracy(
          [sys.executable, 'reference_baseline.py', *data_dir],
          r'epoch (\d+) eval_accuracy ([0-9.]+)'))
  runs['project']['peak_rss_mb_benchmark'] = resource.getrusage(
      resource.RUSAGE_SELF).ru_maxrss / 1024
  report = {'device': str(jax.devices()[0].device_kind), 'num_devices': jax.device_count(),
            'cpu_count': os.cpu_count(), 'matmul_gflops': peak / 1e9, 'config': str(
                FLAGS['config'].config_filename), 'steps': FLAGS.steps, 'runs': runs}
  names = sorted({key for figures in runs.values() for key in figures})
  print(f'\n{"figure":32s}' + ''.join(f'{name:>14s}' for name in runs))
  for key in names:
    print(f'{key:32s}' + ''.join(f'{runs[name].get(key, float("nan")):14.4g}' for name in runs))
  if 'reference' in runs:
    speedup = (runs['project']['train_examples_per_sec'] /
               runs['reference']['train_examples_per_sec'])
    report['train_speedup_vs_reference'] = speedup
    print(f'{"train speed-up vs reference":32s}{speedup:14.2f}x')
  print(f'matmul peak {peak / 1e9:.1f} GFLOP/s on {report["device"]}')
  with open(FLAGS.json, 'w') as f:
    json.dump(report, f, indent=2)


if __name__ == '__main__':
  app.run(main)

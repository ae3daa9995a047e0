"""benchmark.py's in-process measurement on real MNIST (its figures, not its speed)."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # Launches main.py / the benchmark on real MNIST.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('program', ['project', 'reference'])
def test_measurement_reports_every_figure(tfds_data_dir, tmp_path, program):
  out = tmp_path / 'figures.json'
  subprocess.run(
      # The project's eval (run 4 times) reads the first 2,000 test images, one batch: all
      # 10,000 were 40,000 forward passes for 3 timed training steps. The reference program
      # evaluates its own test set.
      [sys.executable, '-m', 'benchmarks.benchmark', f'--measure={program}', '--steps=3', f'--json={out}',
       f'--config.data_dir={tfds_data_dir}', '--config.eval_split=test[:2000]',
       '--config.eval_batch_size=2000'],
      cwd=ROOT, check=True, capture_output=True, timeout=600,
      env={**os.environ, 'TFDS_DATA_DIR': tfds_data_dir})
  figures = json.loads(out.read_text())
  for key in ['compile_s', 'train_examples_per_sec', 'eval_examples_per_sec', 'matmul_gflops',
              'step_ms_input_wait', 'step_ms_dispatch', 'step_ms_compute', 'peak_rss_mb']:
    assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])
  # The CNN's forward pass is ~9.3 MFLOPs per example (convs 7.6M, dense layers 1.6M); a train
  # step is about three times that, however XLA's cost analysis counts the rest.
  assert 2.2e7 < figures['flops_per_example'] < 3.6e7, figures['flops_per_example']
  assert 0 < figures['fraction_of_matmul_peak'] < 1.5


def test_step_profile_names_each_operation_and_counts_matmul_flops():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from benchmarks import hlo  # pylint: disable=g-import-not-at-top

  def layer(x, kernel):
    return jnp.maximum(x @ kernel, 0.0)

  x, kernel = jnp.ones((64, 32)), jnp.ones((32, 16))
  forward = hlo.operations(jax.jit(layer).lower(x, kernel).compile().as_text())
  assert [op.flops for op in forward.values() if op.flops] == [2 * 64 * 32 * 16]
  assert not any(op.backward for op in forward.values())
  gradient = jax.jit(jax.grad(lambda k: layer(x, k).sum()))
  backward = hlo.operations(gradient.lower(kernel).compile().as_text())
  # The gradient's program runs the forward matmul again, then dW = x^T @ dy.
  matmuls = sorted((op.backward, op.flops) for op in backward.values() if op.flops)
  assert matmuls == [(False, 2 * 64 * 32 * 16), (True, 2 * 64 * 32 * 16)]

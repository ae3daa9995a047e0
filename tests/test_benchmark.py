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
      [sys.executable, '-m', 'benchmarks.benchmark', f'--measure={program}', '--steps=3', f'--json={out}',
       f'--config.data_dir={tfds_data_dir}', '--config.eval_batch_size=2000'],
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

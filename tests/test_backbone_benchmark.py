"""benchmarks/backbones.py: its summary, and the whole benchmark at a tiny size (slow tier)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import backbones
from tests.helpers.optional import requires_extras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ('resnet50', 'vit_small_patch16_224')
DTYPES = ('float32', 'bfloat16')


def _run(step_seconds: float) -> dict:
  return {'images_per_sec': 32 / step_seconds, 'median_step_seconds': step_seconds,
          'first_step_seconds': 10 * step_seconds, 'load_1min': 1.0, 'peak_rss_mb': 900.0,
          'threads': 2,
          'device_name': 'cpu'}


def test_summary_takes_medians_and_compares_with_the_fastest_pytorch_of_its_model_and_dtype():
  every_round = {('resnet50', 'float32', 'jax_auto'): [_run(2.0), _run(4.0), _run(3.0)],
                 ('resnet50', 'float32', 'torch_eager'): [_run(8.0)],
                 ('resnet50', 'float32', 'torch_compile'): [_run(4.0)],
                 ('resnet50', 'bfloat16', 'jax_auto'): [_run(1.0)]}
  rows = {(row['model'], row['dtype'], row['configuration']): row
          for row in backbones.summarize(every_round)}
  assert rows['resnet50', 'float32', 'jax_auto']['median_step_seconds'] == 3.0
  # Against torch_compile (8 images/s), the faster PyTorch configuration of its model and dtype.
  assert rows['resnet50', 'float32', 'jax_auto']['vs_best_torch'] == pytest.approx(
      (32 / 3.0) / (32 / 4.0))
  assert rows['resnet50', 'float32', 'torch_eager']['vs_best_torch'] == pytest.approx(0.5)
  assert rows['resnet50', 'bfloat16', 'jax_auto']['vs_best_torch'] is None  # No PyTorch row.
  table = backbones.markdown_table(list(rows.values())).splitlines()
  assert len(table) == 2 + len(rows)


def _benchmark(tmp_path, configurations: list[str], models: tuple[str, ...],
               dtypes: tuple[str, ...]) -> tuple[str, dict]:
  """Runs the benchmark at a tiny size, one round; its stdout and JSON report."""
  out = tmp_path / 'backbones.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.backbones', '--image_size=32', '--batch_size=2',
       '--warmup=1', '--steps=1', '--rounds=1', f'--models={",".join(models)}',
       f'--dtypes={",".join(dtypes)}', f'--configurations={",".join(configurations)}',
       f'--json={out}'], cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout, json.loads(out.read_text())


def _check_every_row(stdout: str, report: dict, configurations: list[str],
                     models: tuple[str, ...], dtypes: tuple[str, ...]) -> None:
  expected = {(model, dtype, configuration) for model in models for dtype in dtypes
              for configuration in configurations}
  rows = {(row['model'], row['dtype'], row['configuration']): row for row in report['rows']}
  assert rows.keys() == expected
  for key, row in rows.items():
    assert row['images_per_sec'] > 0, key
    assert row['images_per_sec'] == pytest.approx(2 / row['median_step_seconds'])
    assert f'| {" | ".join(key)} | ' in stdout, key
    assert row['peak_rss_mb'] > 100, key  # A Python process with JAX or PyTorch in it.
  assert 'avx2' in stdout.splitlines()[0]  # The ISA line comes first.
  assert 'Load average at start' in stdout


# Each configuration is a child process that imports its framework and compiles the model (a
# torch.compile takes minutes on 2 cores): the tests run as few as show every kind of row.
@pytest.mark.slow
def test_benchmark_has_a_row_for_each_dtype_in_jax(tmp_path):
  configurations, models = ['jax_auto'], MODELS[1:]
  stdout, report = _benchmark(tmp_path, configurations, models, DTYPES)
  _check_every_row(stdout, report, configurations, models, DTYPES)
  assert report['machine']['usable_cores'] == len(os.sched_getaffinity(0))


@pytest.mark.slow
def test_benchmark_has_a_row_for_each_pytorch_configuration(tmp_path):
  requires_extras('torch', 'timm')
  configurations, models, dtypes = ['torch_eager', 'torch_compile'], MODELS[1:], DTYPES[:1]
  stdout, report = _benchmark(tmp_path, configurations, models, dtypes)
  _check_every_row(stdout, report, configurations, models, dtypes)
  assert all(row['vs_best_torch'] <= 1.0 for row in report['rows'])

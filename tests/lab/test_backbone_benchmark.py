"""benchmarks/backbones.py: its summary, and the whole benchmark at a toy size (slow tier)."""

import json
import math
import os
import subprocess
import sys
import types
from unittest import mock

import pytest

from benchmarks import backbones
from tests.helpers.optional import requires_extras

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(step_seconds: float) -> dict:
  return {'images_per_sec': 32 / step_seconds, 'median_step_seconds': step_seconds,
          'first_step_seconds': 10 * step_seconds, 'load_1min': 1.0, 'peak_rss_mb': 900.0,
          'page_faults_per_step': 1000 * step_seconds, 'threads': 2,
          'device_name': 'cpu'}


def test_summary_takes_medians_and_compares_with_the_fastest_pytorch_of_its_model_and_dtype():
  every_round = {('resnet50', 'float32', 'jax_auto'): [_run(2.0), _run(4.0), _run(3.0)],
                 ('resnet50', 'float32', 'torch_eager'): [_run(8.0)],
                 ('resnet50', 'float32', 'torch_compile'): [_run(4.0)],
                 ('resnet50', 'bfloat16', 'jax_auto'): [_run(1.0)]}
  rows = {(row['model'], row['dtype'], row['configuration']): row
          for row in backbones.summarize(every_round)}
  assert rows['resnet50', 'float32', 'jax_auto']['median_step_seconds'] == 3.0
  assert rows['resnet50', 'float32', 'jax_auto']['page_faults_per_step'] == 3000
  # Against torch_compile (8 images/s), the faster PyTorch configuration of its model and dtype.
  assert rows['resnet50', 'float32', 'jax_auto']['vs_best_torch'] == pytest.approx(
      (32 / 3.0) / (32 / 4.0))
  assert rows['resnet50', 'float32', 'torch_eager']['vs_best_torch'] == pytest.approx(0.5)
  assert rows['resnet50', 'bfloat16', 'jax_auto']['vs_best_torch'] is None  # No PyTorch row.
  table = backbones.markdown_table(list(rows.values())).splitlines()
  assert len(table) == 2 + len(rows)


def test_mfu_is_xlas_flops_per_second_over_the_peak_and_pytorch_rows_borrow_the_apps_flops():
  jax_run = {**_run(2.0), 'flops_per_step': 4e12, 'peak_flops': 1e14, 'state_seconds': 3.0,
             'compile_seconds': 5.0, 'devices': 1, 'platform_version': 'tpu runtime'}
  every_round = {('vit_small_patch16_224', 'bfloat16', 'jax_off'): [jax_run],
                 ('vit_small_patch16_224', 'bfloat16', 'big_vision'): [
                     {**jax_run, 'flops_per_step': 3e12, 'median_step_seconds': 1.0}],
                 ('vit_small_patch16_224', 'bfloat16', 'torch_eager'): [_run(4.0)]}
  for runs in every_round.values():  # As run_configuration adds it to each run.
    for run in runs:
      run['mfu'] = backbones.mfu(run.get('flops_per_step'), run.get('peak_flops'),
                                 run['median_step_seconds'])
  rows = {row['configuration']: row for row in backbones.summarize(every_round)}
  assert rows['jax_off']['mfu'] == pytest.approx(4e12 / 2.0 / 1e14)
  assert rows['big_vision']['mfu'] == pytest.approx(3e12 / 1.0 / 1e14)
  # PyTorch's step does the app's work: its MFU counts the app's FLOPs (4e12) at its own rate.
  assert rows['torch_eager']['mfu'] == pytest.approx(4e12 / 4.0 / 1e14)
  assert rows['jax_off']['state_seconds'] == 3.0 and rows['jax_off']['compile_seconds'] == 5.0
  assert rows['torch_eager']['state_seconds'] is None
  assert '| 2.0% |' in backbones.markdown_table(list(rows.values()))
  assert backbones.mfu(None, 1e14, 1.0) is None and backbones.mfu(1e12, None, 1.0) is None


def test_the_big_vision_rows_are_left_out_and_said_so_without_a_checkout(tmp_path, capsys):
  chosen = types.SimpleNamespace(task='train', device='tpu', configurations=None,
                                 big_vision=str(tmp_path))  # No big_vision/models/vit.py.
  with mock.patch.object(backbones, 'FLAGS', chosen):
    assert backbones.selected_configurations() == ['jax_auto']
    assert 'No big_vision rows' in capsys.readouterr().out
    (tmp_path / 'big_vision' / 'models').mkdir(parents=True)
    (tmp_path / 'big_vision' / 'models' / 'vit.py').touch()
    assert backbones.selected_configurations() == ['jax_auto', 'big_vision']


# The whole benchmark at a toy size, one round: its toy ResNet (one basic block per stage, 8-32
# features, in both libraries) on 32-px images, batch 2, one warm-up and one timed step per
# child. Each row is a child process that imports its framework and compiles the model, so the
# test runs one per library (torch.compile's children take minutes on 2 cores; more rows are
# the summary's test above); inference adds the app's ONNX export in ONNX Runtime and its TFLite
# export in LiteRT's interpreter.
@pytest.mark.slow
@pytest.mark.parametrize('task, configurations', [
    ('train', ['jax_off', 'torch_eager']),
    ('inference', ['jax_off', 'torch_eager', 'onnxruntime', 'tflite'])])
def test_benchmark_has_a_row_for_each_model_dtype_and_configuration(tmp_path, task,
                                                                    configurations):
  requires_extras('torch', 'timm', *(['jax2onnx', 'onnxruntime', 'ai_edge_litert']
                                     if task == 'inference' else []))
  dtypes = ['float32']
  out = tmp_path / 'backbones.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.backbones', f'--task={task}', '--image_size=32',
       '--batch_size=2', '--warmup=1', '--steps=1', '--rounds=1', '--models=toy_resnet',
       f'--dtypes={",".join(dtypes)}', f'--configurations={",".join(configurations)}',
       f'--json={out}', f'--trace_dir={tmp_path / "traces"}'], cwd=ROOT, capture_output=True,
      text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert {'command', 'commit', 'machine', 'date'} <= report.keys()
  assert report['task'] == task
  rows = {(row['model'], row['dtype'], row['configuration']): row for row in report['rows']}
  assert rows.keys() == {('toy_resnet', dtype, configuration) for dtype in dtypes
                         for configuration in configurations}
  for key, row in rows.items():
    assert math.isfinite(row['images_per_sec']) and row['images_per_sec'] > 0, key
    assert row['images_per_sec'] == pytest.approx(2 / row['median_step_seconds'])
    assert row['first_step_seconds'] > 0 and row['threads'] >= 1, key
    assert row['peak_rss_mb'] > 100, key  # A Python process with JAX or PyTorch in it.
    assert row['page_faults_per_step'] >= 0, key
    assert f'| {" | ".join(key)} | ' in result.stdout, key
  assert rows['toy_resnet', 'float32', 'torch_eager']['vs_best_torch'] == 1.0
  for export_row in ('onnxruntime', 'tflite'):  # Each export's file, as a device gets it.
    if export_row in configurations:
      assert rows['toy_resnet', 'float32', export_row]['export_bytes'] > 10_000, export_row
  if task == 'train':  # The JAX row's timed steps traced by the profiler; none for PyTorch's.
    traced = [name for _, _, names in os.walk(tmp_path / 'traces') for name in names]
    assert os.listdir(tmp_path / 'traces') == ['jax_off_toy_resnet_float32'], traced
    assert any(name.endswith('.xplane.pb') for name in traced), traced
  assert result.stdout.startswith('CPU: ')  # The machine's line comes first.
  assert report['machine']['usable_cores'] == len(os.sched_getaffinity(0))

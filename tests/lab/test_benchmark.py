"""The lab's tests, the one test file that imports it: the benchmarks' harness, the run recorder,
benchmark.py's measurement at toy sizes, backbones.py's summary and its whole run at a toy size,
and the app's CNN against the reference it is measured against (reference_mnist.py, the Flax
MNIST example's model: the same function)."""

import json
import math
import os
import re
import subprocess
import sys
import types
from unittest import mock

from absl import app
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import backbones
from benchmarks import harness
from benchmarks import record
from benchmarks import reference_mnist
import kernels
from tests.helpers.build import create_model
from tests.helpers.optional import requires_extras
from training import state as state_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Abridged `lscpu` of a Sapphire Rapids VM and of an AMD EPYC (Zen 3, AVX2).
SAPPHIRE_RAPIDS = """\
Architecture:            x86_64
CPU family:              6
Model:                   143
Model name:              Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
Flags:                   fpu avx avx2 fma avx512f avx512dq avx512bw avx512_bf16 amx_bf16 amx_tile
"""
EPYC = """\
Model name:              AMD EPYC
CPU family:              25
Model:                   1
Flags:                   fpu sse sse2 avx fma avx2 smep bmi2 vaes
"""


@pytest.mark.parametrize('lscpu, expected', [
    (SAPPHIRE_RAPIDS, {'cpu_model': 'Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz',
                       'cpu_family': '6', 'cpu_model_number': '143', 'avx2': True,
                       'avx512f': True, 'avx512_bf16': True, 'amx_bf16': True, 'amx_tile': True}),
    (EPYC, {'cpu_model': 'AMD EPYC', 'cpu_family': '25', 'cpu_model_number': '1', 'avx2': True,
            'avx512f': False, 'avx512_bf16': False, 'amx_bf16': False, 'amx_tile': False}),
    ('', {'cpu_model': 'unknown', 'cpu_family': 'unknown', 'cpu_model_number': 'unknown',
          'avx2': False, 'avx512f': False, 'avx512_bf16': False, 'amx_bf16': False,
          'amx_tile': False}),
])
def test_parse_lscpu(lscpu, expected):
  assert harness.parse_lscpu(lscpu) == expected


def test_machine_line_says_yes_or_no_for_each_feature():
  machine = {**harness.parse_lscpu(EPYC), 'cpu_count': 2, 'usable_cores': 2, 'torch': '2.14.1',
             'jax': '0.10.2'}
  assert harness.machine_line(machine) == (
      'CPU: AMD EPYC (family 25, model 1); avx2 yes, avx512f no, avx512_bf16 no, amx_bf16 no, '
      'amx_tile no; 2 cores usable (2 online); torch 2.14.1, jax 0.10.2')


def test_markdown_table_aligns_the_columns_it_is_told_to():
  assert harness.markdown_table(['name', 'rate'], [['a', 1.5], ['b', 20]], align='lr') == (
      '| name | rate |\n| --- | ---: |\n| a | 1.5 |\n| b | 20 |')


def test_an_artefact_records_command_commit_machine_date_and_environment(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, 'argv', [os.path.join(ROOT, 'benchmarks', 'backbones.py'), '--rounds=1',
                                    '--json=a b.json'])
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_enable_fast_math=false')
  monkeypatch.setenv('GLIBC_TUNABLES', 'glibc.malloc.hugetlb=1')
  path = tmp_path / 'figures.json'
  harness.write_json(str(path), {'rows': [1, 2]})
  artefact = json.loads(path.read_text())
  assert artefact['rows'] == [1, 2]
  assert artefact['command'] == "python -m benchmarks.backbones --rounds=1 '--json=a b.json'"
  assert len(artefact['commit']) == 40 and isinstance(artefact['uncommitted_changes'], bool)
  assert artefact['machine']['usable_cores'] == len(os.sched_getaffinity(0))
  assert set(harness.ISA_FEATURES) <= artefact['machine'].keys()
  assert artefact['date'].endswith('+00:00')
  assert artefact['xla_flags'] == '--xla_cpu_enable_fast_math=false'
  assert artefact['glibc_tunables'] == 'glibc.malloc.hugetlb=1'
  assert os.listdir(tmp_path) == ['figures.json']  # No temporary file left.


def test_a_child_reports_its_time_and_peak_memory_and_a_failure_its_output(tmp_path):
  log = tmp_path / 'child.log'
  child = harness.run_child([sys.executable, '-c', 'x = bytearray(200 * 2**20); print("done")'],
                            log_path=str(log))
  assert child.returncode == 0 and child.output_tail == log.read_text() == 'done\n'
  assert child.seconds > 0 and child.peak_rss_mb > 200  # Its own peak, not this process's.
  with pytest.raises(RuntimeError, match='status 3') as raised:
    harness.run_child([sys.executable, '-c', 'print("why"); raise SystemExit(3)'])
  assert 'why' in str(raised.value)
  assert harness.run_child([sys.executable, '-c', 'raise SystemExit(3)'],
                           check=False).returncode == 3


def test_a_child_is_stopped_at_the_line_asked_for():
  lines = []
  child = harness.run_child(
      [sys.executable, '-u', '-c', 'import time\nfor i in range(100):\n print(i)\n time.sleep(1)'],
      stop=lambda line: lines.append(line) or line == '2\n')
  assert lines == ['0\n', '1\n', '2\n'] and child.returncode != 0 and child.seconds < 30


def test_json_child_returns_what_the_child_wrote_to_its_json_flag():
  script = 'import json, sys; json.dump({"argv": sys.argv[1:]}, open(sys.argv[-1][7:], "w"))'
  figures, child = harness.json_child([sys.executable, '-c', script, '--a=1'])
  assert figures['argv'][0] == '--a=1' and figures['argv'][1].startswith('--json=')
  assert child.returncode == 0


def test_time_calls_stops_at_its_budget():
  assert len(harness.time_calls(lambda: None, 5)) == 5
  assert len(harness.time_calls(lambda: sum(range(10**5)), 1000, budget_s=0.0)) == 1


def _write_metrics(workdir, lines):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w', encoding='utf-8') as file:
    file.write(''.join(json.dumps(line) + '\n' for line in lines))


def test_final_metrics_are_each_metrics_last_value(tmp_path):
  _write_metrics(tmp_path, [{'step': 10, 'train/loss': 0.5},
                            {'step': 20, 'epoch': 1, 'eval/accuracy': 0.9},
                            {'step': 20, 'train/loss': 0.3}, {'step': 40, 'train/loss': 0.2}])
  steps = harness.read_metrics(str(tmp_path))
  assert [values['step'] for values in steps] == [10, 20, 40]
  assert harness.final_metrics(steps) == {'step': 40, 'train/loss': 0.2, 'epoch': 1,
                                          'eval/accuracy': 0.9}


def test_record_runs_the_command_and_writes_its_figures(tmp_path, monkeypatch):
  """benchmarks/record.py around a stand-in for main.py that writes a workdir's metrics."""
  workdir, out = tmp_path / 'run', tmp_path / 'run.json'
  script = ('import json, os, sys; w = sys.argv[1].split("=")[1]; os.makedirs(w); '
            'f = open(os.path.join(w, "metrics.jsonl"), "w"); '
            'f.write(json.dumps({"step": 5, "epoch": 1, "eval/accuracy": 0.5}) + "\\n"); '
            'f.write(json.dumps({"step": 9, "train/loss": 0.1, "test/accuracy": 0.7}) + "\\n")')
  command = ['python', '-c', script, f'--workdir={workdir}']
  monkeypatch.setattr(sys, 'argv', [os.path.join(ROOT, 'benchmarks', 'record.py'),
                                    f'--json={out}', '--', *command])
  record.record(command, str(out))
  artefact = json.loads(out.read_text())
  assert artefact['command'].startswith(f'python -m benchmarks.record --json={out} -- python -c')
  assert artefact['run']['returncode'] == 0 and artefact['run']['wall_s'] > 0
  assert artefact['run']['peak_rss_mb'] > 0 and artefact['run']['workdir'] == str(workdir)
  assert artefact['final_metrics'] == {'step': 9, 'epoch': 1, 'eval/accuracy': 0.5,
                                       'train/loss': 0.1, 'test/accuracy': 0.7}
  assert artefact['evaluations'] == [{'step': 5, 'epoch': 1, 'eval/accuracy': 0.5},
                                     {'step': 9, 'test/accuracy': 0.7}]
  assert artefact['training'] == [{'step': 9, 'train/loss': 0.1}]
  assert {'commit', 'machine', 'date'} <= artefact.keys()


def test_record_writes_nothing_for_a_failed_run(tmp_path):
  """The command line: the command after `--`; a failed run ends the recorder, no artefact."""
  out = tmp_path / 'run.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.record', f'--json={out}', '--', 'python', '-c',
       'raise SystemExit(2)', f'--workdir={tmp_path}'], cwd=ROOT, capture_output=True,
      text=True, timeout=300)
  assert result.returncode == 1 and result.stderr.strip().endswith('not written.')
  assert not out.exists()


def test_record_needs_the_workdir_it_reads():
  with pytest.raises(Exception, match='names no --workdir'):
    record.workdir_of(['python', 'main.py', '--config=configs/default.py'])
  assert record.workdir_of(['python', 'main.py', '--workdir', 'w']) == 'w'


@pytest.mark.slow  # Starts JAX and TensorFlow in a child, on real MNIST.
@pytest.mark.parametrize('program', ['project', 'reference'])
def test_measurement_reports_every_figure(tfds_data_dir, tmp_path, program):
  out = tmp_path / 'figures.json'
  subprocess.run(
      # Toy sizes: 3 timed steps, a 64x64 matmul, and the eval (run 4 times) on 500 test images
      # (the project's in one batch; the reference's in its batches of 128).
      [sys.executable, '-m', 'benchmarks.benchmark', f'--measure={program}', '--steps=3',
       '--matmul_size=64', f'--json={out}', f'--config.data_dir={tfds_data_dir}',
       '--config.eval_split=test[:500]', '--config.eval_batch_size=500'],
      cwd=ROOT, check=True, capture_output=True, timeout=600,
      env={**os.environ, 'TFDS_DATA_DIR': tfds_data_dir})
  figures = json.loads(out.read_text())
  for key in ['compile_s', 'train_examples_per_sec', 'eval_examples_per_sec', 'matmul_gflops',
              'step_ms_input_wait', 'step_ms_dispatch', 'step_ms_compute', 'peak_rss_mb',
              'fraction_of_matmul_peak']:
    assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])
  # The CNN's forward pass is ~9.3 MFLOPs per example (convs 7.6M, dense layers 1.6M); a train
  # step is about three times that, however XLA's cost analysis counts the rest.
  assert 2.2e7 < figures['flops_per_example'] < 3.6e7, figures['flops_per_example']


def _importing_the_lab(top: str, skip: tuple[str, ...]) -> list[str]:
  """The Python files under `top` (hidden folders and `skip`ped ones left out) that import
  benchmarks, relative to the repository's root."""
  found = []
  for folder, folders, files in os.walk(top):
    folders[:] = [name for name in folders
                  if not name.startswith('.') and os.path.join(folder, name) not in skip]
    for name in (name for name in files if name.endswith('.py')):
      with open(os.path.join(folder, name), encoding='utf-8') as file:
        if re.search(r'^\s*(from|import) benchmarks\b', file.read(), re.M):
          found.append(os.path.relpath(os.path.join(folder, name), ROOT))
  return found


def test_only_the_labs_own_tests_import_the_lab():
  # The lab (benchmarks/) imports the app, never the reverse; of the tests, only this one
  # imports it, so that the product's tests stand without it.
  lab_tests = os.path.dirname(os.path.abspath(__file__))
  assert _importing_the_lab(os.path.join(ROOT, 'tests'), (lab_tests,)) == []
  assert _importing_the_lab(ROOT, tuple(os.path.join(ROOT, name)
                                        for name in ('benchmarks', 'tests'))) == []
  assert _importing_the_lab(lab_tests, ()) == ['tests/lab/test_benchmark.py']


def test_backbones_rows_are_every_model_and_dtype_or_the_pairs_given():
  assert backbones.model_dtype_pairs(['a', 'b'], ['f', 'g'], None) == [
      ('a', 'f'), ('a', 'g'), ('b', 'f'), ('b', 'g')]
  assert backbones.model_dtype_pairs(['a'], ['f'], ['b:g', 'a:f']) == [('b', 'g'), ('a', 'f')]
  with pytest.raises(app.UsageError):
    backbones.model_dtype_pairs(['a'], ['f'], ['a'])


def test_an_artefact_rewritten_in_place_is_not_an_uncommitted_change(tmp_path, monkeypatch):
  """A benchmark rewrites its committed artefact after every row: only other changes count."""
  git = lambda *args: subprocess.run(['git', '-C', str(tmp_path), *args], check=True,
                                     capture_output=True)
  git('init', '-q')
  for name in ('figures.json', 'code.py'):
    (tmp_path / name).write_text('0')
  git('add', '.')
  git('-c', 'user.name=lab', '-c', 'user.email=lab@localhost', 'commit', '-qm', 'start')
  monkeypatch.setattr(harness, 'ROOT', str(tmp_path))
  artefact = str(tmp_path / 'figures.json')
  (tmp_path / 'figures.json').write_text('1')
  assert harness.git_commit(artefact)['uncommitted_changes'] is False
  assert harness.git_commit()['uncommitted_changes'] is True
  (tmp_path / 'code.py').write_text('1')
  assert harness.git_commit(artefact)['uncommitted_changes'] is True
  # An artefact written outside the checkout: git refuses its pathspec; the change still counts.
  assert harness.git_commit(str(tmp_path.parent / 'out.json'))['uncommitted_changes'] is True


# benchmarks/backbones.py

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


# benchmarks/reference_mnist.py

@pytest.mark.parametrize('kernels_setting', kernels.KERNELS)
def test_cnn_is_the_reference_example_function(kernels_setting):
  """The same parameters give the reference CNN's outputs in eval mode, and in training mode the
  same outputs and gradients when dropout is deterministic (the masks are random by design)."""
  model = create_model('cnn', kernels=kernels_setting)
  reference = state_lib.run_once(lambda: reference_mnist.ReferenceCNN(rngs=nnx.Rngs(1)))
  nnx.update(reference, *nnx.state(model, nnx.Param, nnx.BatchStat))
  x = jax.random.uniform(jax.random.key(0), (16, 28, 28, 1))
  for train in (False, True):
    for module in (model, reference):
      module.eval() if not train else module.set_attributes(deterministic=True)
    loss = lambda module: jnp.sin(module(x)).sum()
    outputs = [nnx.jit(lambda module: module(x))(module) for module in (model, reference)]
    np.testing.assert_allclose(*outputs, rtol=1e-4, atol=1e-4)
    grads, reference_grads = (nnx.jit(nnx.grad(loss))(module) for module in (model, reference))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
                 grads, reference_grads)

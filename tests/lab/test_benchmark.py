"""The benchmarks' harness, the run recorder, and benchmark.py's measurement at toy sizes."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from benchmarks import harness
from benchmarks import record

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
  # The lab (benchmarks/) imports the app, never the reverse; of the tests, only those of
  # tests/lab/ import it, so that the product's tests stand without it.
  lab_tests = os.path.dirname(os.path.abspath(__file__))
  assert _importing_the_lab(os.path.join(ROOT, 'tests'), (lab_tests,)) == []
  assert _importing_the_lab(ROOT, tuple(os.path.join(ROOT, name)
                                        for name in ('benchmarks', 'tests'))) == []
  assert 'tests/lab/test_benchmark.py' in _importing_the_lab(lab_tests, ())


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

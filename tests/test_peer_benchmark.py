"""The PyTorch peer benchmark: its model, its training program, and peer.py's parsers and table."""

import json
import math
import os
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import pytest

from benchmarks import peer
from tests.helpers.optional import SHARED_MNIST
from tests.helpers.optional import requires_extras
import kernels
import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Abridged /proc/cpuinfo of a 2-processor Sapphire Rapids VM: the first processor's fields count.
SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx avx2 fma avx512f avx512dq avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx avx2 fma avx512f avx512dq avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC = """\
processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 smep bmi2 vaes
"""


@pytest.fixture
def mnist_dir() -> str:
  """A directory holding the four original MNIST .gz files."""
  candidates = [SHARED_MNIST]
  if 'TFDS_DATA_DIR' in os.environ:
    candidates.append(pathlib.Path(os.environ['TFDS_DATA_DIR'], 'downloads', 'manual'))
  for candidate in candidates:
    if (candidate / 'train-images-idx3-ubyte.gz').is_file():
      return str(candidate)
  pytest.skip(f'the original MNIST files are in none of {[str(c) for c in candidates]}')


def test_torch_cnn_has_the_parameters_of_models_cnn():
  requires_extras('torch')
  from benchmarks import pytorch_mnist  # pylint: disable=g-import-not-at-top  (torch: optional)
  flax_model = models.CNN((28, 28, 1), 10, layers=kernels.STOCK_LAYERS, rngs=nnx.Rngs(0))
  flax_sizes = [leaf.size for leaf in jax.tree.leaves(nnx.state(flax_model, nnx.Param))]
  torch_sizes = [parameter.numel() for parameter in pytorch_mnist.CNN().parameters()]
  assert sum(torch_sizes) == sum(flax_sizes) == 824_650
  assert sorted(torch_sizes) == sorted(flax_sizes)  # Layer by layer, too.


def test_peer_knows_the_variants_of_the_pytorch_program():
  requires_extras('torch')
  from benchmarks import pytorch_mnist  # pylint: disable=g-import-not-at-top  (torch: optional)
  assert tuple(peer.TORCH_VARIANTS) == pytorch_mnist.VARIANTS


def test_read_metrics_merges_the_lines_of_each_epoch_end(tmp_path):
  lines = [
      {'step': 100, 'train/loss': 0.5, 'train/examples_per_sec': 900.0},  # Mid-epoch.
      {'step': 200, 'epoch': 1, 'train/examples_per_sec': 1000.0, 'train/loss': 0.3},
      {'step': 200, 'eval/accuracy': 0.97, 'eval/loss': 0.1},
      {'step': 400, 'eval/accuracy': 0.98},
      {'step': 400, 'epoch': 2, 'train/examples_per_sec': 1100.0},
      {'step': 400, 'test/accuracy': 0.99},
  ]
  path = tmp_path / 'metrics.jsonl'
  path.write_text(''.join(json.dumps(line) + '\n' for line in lines) + '\n')
  assert peer.read_metrics(str(path)) == [
      {'step': 200, 'epoch': 1, 'train_examples_per_sec': 1000.0, 'eval_accuracy': 0.97},
      {'step': 400, 'epoch': 2, 'train_examples_per_sec': 1100.0, 'eval_accuracy': 0.98}]


def test_read_metrics_skips_an_epoch_end_without_its_eval(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text(json.dumps({'step': 200, 'epoch': 1, 'train/examples_per_sec': 1000.0}))
  assert not peer.read_metrics(str(path))


@pytest.mark.parametrize('cpuinfo, expected', [
    (SAPPHIRE_RAPIDS, {'cpu_model': 'Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz',
                       'avx2': True, 'avx512f': True, 'avx512_bf16': True, 'amx_bf16': True,
                       'amx_tile': True}),
    (EPYC, {'cpu_model': 'AMD EPYC', 'avx2': True, 'avx512f': False, 'avx512_bf16': False,
            'amx_bf16': False, 'amx_tile': False}),
    ('', {'cpu_model': 'unknown', 'avx2': False, 'avx512f': False, 'avx512_bf16': False,
          'amx_bf16': False, 'amx_tile': False}),
])
def test_parse_cpuinfo(cpuinfo, expected):
  assert peer.parse_cpuinfo(cpuinfo) == expected


def test_machine_line_says_yes_or_no_for_each_feature():
  machine = {**peer.parse_cpuinfo(EPYC), 'cpu_count': 2, 'usable_cores': 2, 'torch': '2.14.1',
             'jax': '0.10.2'}
  assert peer.machine_line(machine) == (
      'CPU: AMD EPYC; avx2 yes, avx512f no, avx512_bf16 no, amx_bf16 no, amx_tile no; 2 cores '
      'usable (2 online); torch 2.14.1, jax 0.10.2')


def test_summary_compares_each_configuration_with_its_library_and_dtype_peak():
  configurations = [peer.CONFIGURATIONS[name] for name in
                    ['torch_eager', 'torch_autocast_bf16', 'project_off_bfloat16']]
  run = lambda speed: {'train_examples_per_sec': speed, 'process_seconds': 60.0,
                       'eval_accuracy': 0.98}
  every_round = {'torch_eager': [run(1000.0), run(3000.0), run(2000.0)],
                 'torch_autocast_bf16': [run(10.0)] * 3,
                 'project_off_bfloat16': [run(500.0)] * 3}
  libraries = {
      'torch': [{'matmul_gflops': {'float32': 100.0, 'bfloat16': 1.0},
                 'flops_per_example': 2e7}] * 3,
      'jax': [{'matmul_gflops': {'float32': 80.0, 'bfloat16': 50.0},
               'flops_per_example': {'project_off_bfloat16': 3e7}}] * 3}
  summary = peer.summarize(configurations, every_round, libraries)
  runs = summary['runs']
  assert runs['torch_eager']['train_examples_per_sec'] == 2000.0  # The median.
  assert runs['torch_eager']['share_of_matmul_peak'] == pytest.approx(2e7 * 2000 / 100e9)
  assert runs['torch_autocast_bf16']['share_of_matmul_peak'] == pytest.approx(2e7 * 10 / 1e9)
  assert runs['project_off_bfloat16']['share_of_matmul_peak'] == pytest.approx(3e7 * 500 / 50e9)
  table = peer.markdown_table(configurations, runs, epochs=2).splitlines()
  assert len(table) == 2 + len(configurations)
  assert table[2] == ('| torch_eager | 2,000 | 60.0 | 0.9800 | 20.0M | 40.0% (torch, float32: '
                      '100.0) |')


@pytest.mark.slow  # Launches peer.py and its children on real MNIST.
def test_peer_runs_the_pytorch_peer_and_prints_its_table(mnist_dir, tmp_path):
  requires_extras('torch')
  out = tmp_path / 'peer.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.peer', '--variants=torch_eager', '--rounds=1',
       '--epochs=1', '--train_examples=2560', f'--mnist_dir={mnist_dir}', f'--json={out}'],
      cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
  assert result.stdout.startswith('CPU: ')
  assert '| torch_eager |' in result.stdout
  report = json.loads(out.read_text())
  # The PyTorch program's own figures, as its child wrote them (benchmarks/pytorch_mnist.py).
  (figures,) = report['every_round']['runs']['torch_eager']
  assert figures['variant'] == 'eager' and figures['train_examples'] == 2560
  assert figures['num_threads'] >= 1
  (epoch,) = figures['every_epoch']
  assert epoch['epoch'] == 1
  assert epoch['eval_accuracy'] > 0.5, epoch  # 20 steps; chance is 0.1.
  for key in ['train_examples_per_sec', 'train_seconds', 'seconds_from_start']:
    assert math.isfinite(epoch[key]) and epoch[key] > 0, (key, epoch[key])
  assert figures['seconds_from_start'] >= epoch['seconds_from_start'] > epoch['train_seconds']
  assert set(peer.ISA_FEATURES) <= set(report['machine'])
  run = report['runs']['torch_eager']
  assert run['process_seconds'] > 0 and 0 < run['share_of_matmul_peak'] < 1.5
  # One train step of the CNN: forward ~9.3 MFLOPs per example of convolutions and matmuls,
  # backward about twice that.
  assert 2.2e7 < run['flops_per_example'] < 3.6e7
  for library in ('torch', 'jax'):
    assert all(gflops > 0 for gflops in report['matmul_gflops'][library].values())


def test_configurations_pass_their_options_as_flags():
  assert peer.CONFIGURATIONS['torch_autocast_bf16'].child_flags == ['--variant=autocast_bf16']
  assert peer.CONFIGURATIONS['project_auto_float32'].child_flags == []
  assert peer.CONFIGURATIONS['project_off_bfloat16'].child_flags == [
      '--config.cpu_kernels=off', '--config.compute_dtype=bfloat16']

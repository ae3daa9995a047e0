"""The PyTorch peer benchmark: its model, its training program, peer.py's summary and table, and
the whole benchmark at toy sizes."""

import json
import math
import os
import pathlib
import subprocess
import sys

from flax import nnx
import jax
import pytest

from benchmarks import harness
from benchmarks import peer
from tests.helpers.optional import SHARED_MNIST
from tests.helpers.optional import requires_extras
import kernels
import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def _workdir_with_metrics(tmp_path, lines) -> str:
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
  return str(tmp_path)


def test_epoch_ends_merge_the_writes_of_each_epoch_end(tmp_path):
  workdir = _workdir_with_metrics(tmp_path, [
      {'step': 100, 'train/loss': 0.5, 'train/examples_per_sec': 900.0},  # Mid-epoch.
      {'step': 200, 'epoch': 1, 'train/examples_per_sec': 1000.0, 'train/loss': 0.3},
      {'step': 200, 'eval/accuracy': 0.97, 'eval/loss': 0.1},
      {'step': 400, 'eval/accuracy': 0.98},
      {'step': 400, 'epoch': 2, 'train/examples_per_sec': 1100.0},
      {'step': 400, 'test/accuracy': 0.99},
  ])
  assert peer.epoch_ends(workdir) == [
      {'step': 200, 'epoch': 1, 'train_examples_per_sec': 1000.0, 'eval_accuracy': 0.97},
      {'step': 400, 'epoch': 2, 'train_examples_per_sec': 1100.0, 'eval_accuracy': 0.98}]


def test_epoch_ends_skip_an_epoch_end_without_its_eval(tmp_path):
  workdir = _workdir_with_metrics(
      tmp_path, [{'step': 200, 'epoch': 1, 'train/examples_per_sec': 1000.0}])
  assert not peer.epoch_ends(workdir)


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


@pytest.mark.slow  # Launches peer.py and the PyTorch program on real MNIST.
def test_peer_runs_the_pytorch_peer_and_prints_its_table(mnist_dir, tmp_path):
  """The whole benchmark at toy sizes: 2 training steps, 100 test images, 64x64 matmuls; two
  children (the PyTorch program, and PyTorch's matmul peak and FLOPs)."""
  requires_extras('torch')
  out = tmp_path / 'peer.json'
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.peer', '--variants=torch_eager', '--rounds=1',
       '--epochs=1', '--train_examples=256', '--eval_examples=100',
       '--matmul_size=64', f'--mnist_dir={mnist_dir}',
       f'--json={out}'], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert result.stdout.startswith('CPU: ')
  assert '| torch_eager |' in result.stdout
  report = json.loads(out.read_text())
  assert {'command', 'commit', 'machine', 'date'} <= report.keys()
  assert set(harness.ISA_FEATURES) <= set(report['machine'])
  # The PyTorch program's own figures, as its child wrote them (benchmarks/pytorch_mnist.py).
  (figures,) = report['every_round']['runs']['torch_eager']
  assert figures['variant'] == 'eager' and figures['train_examples'] == 256
  assert figures['num_threads'] >= 1
  (epoch,) = figures['every_epoch']
  assert epoch['epoch'] == 1 and 0 <= epoch['eval_accuracy'] <= 1
  for key in ['train_examples_per_sec', 'train_seconds', 'seconds_from_start']:
    assert math.isfinite(epoch[key]) and epoch[key] > 0, (key, epoch[key])
  assert figures['seconds_from_start'] >= epoch['seconds_from_start'] > epoch['train_seconds']
  run = report['runs']['torch_eager']
  for key in ('train_examples_per_sec', 'process_seconds', 'share_of_matmul_peak'):
    assert math.isfinite(run[key]) and run[key] > 0, (key, run[key])
  # One train step of the CNN: forward ~9.3 MFLOPs per example of convolutions and matmuls,
  # backward about twice that.
  assert 2.2e7 < run['flops_per_example'] < 3.6e7
  assert report['matmul_gflops'].keys() == {'torch'}  # Only the libraries run are measured.
  assert all(gflops > 0 for gflops in report['matmul_gflops']['torch'].values())


def test_configurations_pass_their_options_as_flags():
  assert peer.CONFIGURATIONS['torch_autocast_bf16'].child_flags == ['--variant=autocast_bf16']
  assert peer.CONFIGURATIONS['project_auto_float32'].child_flags == []
  assert peer.CONFIGURATIONS['project_off_bfloat16'].child_flags == [
      '--config.kernels=stock', '--config.compute_dtype=bfloat16']

"""A short real-MNIST run through main.py, read back from its TensorBoard event files."""

import os
import subprocess
import sys

import pytest

from tensorboard.backend.event_processing import event_accumulator
import tensorflow as tf

pytestmark = pytest.mark.slow  # Launches main.py / the benchmark on real MNIST.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAGS = {'train_loss', 'train_accuracy', 'eval_loss', 'eval_accuracy', 'eval_num_examples',
        'learning_rate', 'steps_per_sec'}


def _scalars(workdir):
  """{tag: [(step, value)]} of every scalar summary in the event files of `workdir`."""
  accumulator = event_accumulator.EventAccumulator(workdir, size_guidance={'tensors': 0})
  accumulator.Reload()
  return {tag: [(event.step, float(tf.make_ndarray(event.tensor_proto)))
                for event in accumulator.Tensors(tag)]
          for tag in accumulator.Tags()['tensors']
          if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == 'scalars'}


def test_short_real_mnist_run(tfds_data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  # 300 steps of batch 128 on the first 38,400 training images, then eval on all 10,000.
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
       f'--config.data_dir={tfds_data_dir}', '--config.num_epochs=1',
       '--config.train_split=train[:38400]'],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'epoch 1/1:' in result.stderr

  scalars = _scalars(workdir)
  assert TAGS <= set(scalars), f'missing tags: {TAGS - set(scalars)}'
  assert scalars['eval_num_examples'] == [(300, 10_000.0)]
  (step, accuracy), = scalars['eval_accuracy']
  assert step == 300 and accuracy > 0.95, accuracy
  assert [step for step, _ in scalars['train_loss']] == [100, 200, 300]
  assert scalars['train_loss'][-1][1] < scalars['train_loss'][0][1]

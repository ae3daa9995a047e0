"""A short real-MNIST run through main.py as a user sees it: a quiet console, a closing summary,
TensorBoard and metrics.jsonl, a rerun that says it is done, and modes that need only --workdir.
"""

import json
import os
import subprocess
import sys

import pytest

from training import summaries
from tests.helpers.runs import scalars

pytestmark = pytest.mark.slow  # Launches main.py on real MNIST.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAGS = {'train/loss', 'train/accuracy', 'eval/loss', 'eval/accuracy', 'learning_rate',
        'train/examples_per_sec'}


def main(*args, timeout=900):
  return subprocess.run([sys.executable, 'main.py', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def test_short_real_mnist_run(tfds_data_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  # 150 steps of batch 128 on the first 19,200 training images, then eval on all 10,000
  # (97.9% measured; an untrained CNN reads about 10%).
  flags = ['--config=configs/default.py', f'--workdir={workdir}',
           f'--config.data_dir={tfds_data_dir}', '--config.num_epochs=1',
           '--config.train_split=train[:19200]', '--config.log_every_steps=50',
           '--config.checkpoint_every_steps=125']
  result = main(*flags)
  assert result.returncode == 0, result.stderr[-3000:]
  log = result.stderr
  assert 'epoch 1/1:' in log
  # Quiet: the libraries' start-up notices and INFO lines are hidden; the run ends by saying
  # what it achieved and where everything is.
  for noise in ('oneDNN', 'absl::InitializeLog', "Unable to initialize backend 'tpu'",
                'dataset_info.py', 'Dl Completed', 'cpu_feature_guard',
                'did not provide metrics'):  # Orbax, at the mid-epoch save (step 125).
    assert noise not in log, noise
  assert 'Saved checkpoint at step 125' in log
  summary = log[log.index('Done in'):]
  for expected in ('eval/accuracy', 'kept as --checkpoint=best', os.path.join(workdir,
                   'checkpoints'), summaries.METRICS_FILE, f'tensorboard --logdir {workdir}',
                   f'--workdir={workdir} --mode=predict'):
    assert expected in summary, expected

  board = scalars(workdir)
  assert TAGS <= set(board), f'missing tags: {TAGS - set(board)}'
  (step, accuracy), = board['eval/accuracy']
  assert step == 150 and accuracy > 0.95, accuracy
  assert [step for step, _ in board['train/loss']] == [50, 100, 150]
  assert board['train/loss'][-1][1] < board['train/loss'][0][1]
  # metrics.jsonl holds the same scalars.
  metrics = summaries.read_metrics(workdir)
  assert metrics[150]['eval/accuracy'] == pytest.approx(accuracy)
  assert [step for step in metrics if 'train/loss' in metrics[step]] == [50, 100, 150]

  # A rerun of the finished run says so, before reading any data.
  again = main(*flags)
  assert again.returncode == 0, again.stderr[-3000:]
  assert 'This run finished already (epoch 1 of 1)' in again.stderr
  assert 'Dataset:' not in again.stderr

  # Eval, predict and export read the workdir's config: --workdir is all they need.
  evaluated = main(f'--workdir={workdir}', '--mode=eval', '--config.eval_split=test[:500]')
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  with open(os.path.join(workdir, 'eval_test_500_150.json'), encoding='utf-8') as file:
    report = json.load(file)
  assert report['num_examples'] == 500 and 'eval/accuracy' in report['metrics']
  exported = main(f'--workdir={workdir}', '--mode=export')
  assert exported.returncode == 0, exported.stderr[-3000:]
  with open(os.path.join(workdir, 'export', 'model_card.json'), encoding='utf-8') as file:
    assert json.load(file)['input']['shape'] == ['batch', None, None, 1]

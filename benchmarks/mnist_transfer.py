"""docs/fine_tuning.md's MNIST transfer table: digits 0-4 → 5-9, fine-tuned against from scratch.

    python -m benchmarks.mnist_folders --out=/tmp/mf
    python -m benchmarks.mnist_transfer --folders=/tmp/mf --work=/tmp/mt --seeds=0,1,2 \
      --out=docs/mnist_transfer_runs.json

Pretrains `configs/default.py` on the training images of digits 0-4 (`--pretrain_epochs`,
scored on their test images), then trains the frozen recipe on the 250 training images of
digits 5-9 twice per seed, the same command with and without `init_from` (the head
re-initialised by itself: the source run's class names are other ones, which the run's log says
and `head_renewed` records): the default SGD 0.1, batches of 25, 5 epochs, convolutions and
BatchNorms frozen; both scored on all test images of 5-9 after every epoch. Each run is
`python main.py` in its own process; the figures are read from its metrics.jsonl, and written
with the commands to `--out` (`harness.write_json`: with this command, the commit, the machine
and the date).
"""

import os
import shlex
import shutil
import sys

from absl import app
from absl import flags

from benchmarks import harness

FLAGS = flags.FLAGS
flags.DEFINE_string('folders', None, 'The root written by benchmarks.mnist_folders.')
flags.DEFINE_string('work', None, 'Where the runs\' workdirs and logs go (emptied first).')
flags.DEFINE_list('seeds', ['0'], 'The seeds of the digits 5-9 runs (config.seed).')
flags.DEFINE_integer('pretrain_epochs', 2, 'Epochs of the pretraining on digits 0-4.')
flags.DEFINE_string('out', None, 'The JSON file of the figures.')
flags.mark_flags_as_required(['folders', 'work', 'out'])

# The frozen recipe of docs/fine_tuning.md's table, but for init_from.
RECIPE = ['--config.batch_size=25', '--config.num_epochs=5',
          "--config.freeze=('conv', 'batch_norm')"]


def train(workdir: str, dataset: str, extra: list[str]) -> dict:
  """Runs main.py with configs/default.py on the image folder `dataset` and `extra` flags;
  returns the command, its wall time and each epoch's eval and train accuracy."""
  args = [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
          '--config.data_source=folder', f'--config.dataset={dataset}',
          '--config.eval_split=test', *extra]
  child = harness.run_child(args, log_path=f'{workdir}.log')
  epochs = [values for values in harness.read_metrics(workdir) if 'eval/accuracy' in values]
  # 'train/accuracy' at an epoch's end is over the steps since the last write: the whole epoch
  # where an epoch has fewer steps than config.log_every_steps (the digits 5-9 runs: 10).
  with open(f'{workdir}.log', encoding='utf-8') as log:
    head_renewed = 'its head (linear2.bias, linear2.kernel) starts fresh' in log.read()
  return {'command': shlex.join(['python', *args[1:]]), 'wall_s': round(child.seconds, 1),
          'eval_accuracy': [epoch['eval/accuracy'] for epoch in epochs],
          'train_accuracy': [epoch['train/accuracy'] for epoch in epochs],
          'head_renewed': head_renewed}


def main(argv):
  del argv
  shutil.rmtree(FLAGS.work, ignore_errors=True)
  os.makedirs(FLAGS.work)
  pretrain = os.path.join(FLAGS.work, 'digits04')
  pretrained = train(pretrain, os.path.join(FLAGS.folders, 'digits04'),
                     [f'--config.num_epochs={FLAGS.pretrain_epochs}'])
  runs = []
  for seed in map(int, FLAGS.seeds):
    for arm, init in (('finetune', [f'--config.init_from={pretrain}']), ('scratch', [])):
      run = train(os.path.join(FLAGS.work, f'{arm}{seed}'),
                  os.path.join(FLAGS.folders, 'digits59'),
                  [*RECIPE, f'--config.seed={seed}', *init])
      runs.append({'arm': arm, 'seed': seed, **run})
      print(f'{arm} seed {seed}: eval accuracy by epoch '
            f'{", ".join(f"{value:.4f}" for value in run["eval_accuracy"])}', flush=True)
  harness.write_json(FLAGS.out, {
      'pretrain': {'epochs': FLAGS.pretrain_epochs, **pretrained}, 'runs': runs,
      'mean_last_epoch': {arm: sum(run['eval_accuracy'][-1] for run in runs
                                   if run['arm'] == arm) / len(FLAGS.seeds)
                          for arm in ('finetune', 'scratch')}})


if __name__ == '__main__':
  app.run(main)

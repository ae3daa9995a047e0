"""docs/fine_tuning.md's MNIST transfer table: digits 0-4 → 5-9 from 10, 20 or 50 images a
digit, fine-tuned against from scratch.

    python -m benchmarks.mnist_folders --out=/tmp/mf
    python -m benchmarks.mnist_transfer --folders=/tmp/mf --work=/tmp/mt --seeds=0,1,2 \
      --sizes=10,20,50 --out=docs/mnist_transfer_runs.json

Pretrains `configs/default.py` on the training images of digits 0-4 (`--pretrain_epochs`,
scored on their test images), then, for each size and seed, draws `size` of the 50 training
images of each digit 5-9 (by the seed) and trains on them twice with the recipe
docs/fine_tuning.md gives for small folders (`RECIPE`, or `--recipe`): from scratch, and
fine-tuned from the source run (`init_from`, with `FINETUNE`'s flags or `--finetune`'s: its
features frozen; the head re-initialised by itself: the source run's class names are other
ones, which the run's log says and `head_renewed` records); both scored on all test images of
5-9 after every epoch. Each run is `python main.py` in its own process;
the figures are read from its metrics.jsonl, and written with the commands to `--out`
(`harness.write_json`: with this command, the commit, the machine and the date), with two
checks per size: whether every seed's fine-tuned run ends above its run from scratch, and the
largest rise of a run's eval loss after its best epoch (at most 2x is asked of a recipe).
"""

import os
import shlex
import shutil
import sys

from absl import app
from absl import flags
import numpy as np

from benchmarks import harness

FLAGS = flags.FLAGS
flags.DEFINE_string('folders', None, 'The root written by benchmarks.mnist_folders.')
flags.DEFINE_string('work', None, 'Where the runs\' workdirs and logs go (emptied first).')
flags.DEFINE_list('seeds', ['0'], 'The seeds of the digits 5-9 runs (config.seed) and of the '
                  'images drawn for them.')
flags.DEFINE_list('sizes', ['50'], 'Training images of each digit 5-9 (at most 50).')
flags.DEFINE_integer('pretrain_epochs', 2, 'Epochs of the pretraining on digits 0-4.')
flags.DEFINE_multi_string('recipe', None, 'A main.py flag of both arms of the digits 5-9 runs, '
                          'once per flag (default: RECIPE).')
flags.DEFINE_multi_string('finetune', None, 'A main.py flag of the fine-tuned arm alone, once '
                          'per flag (default: FINETUNE).')
flags.DEFINE_string('out', None, 'The JSON file of the figures.')
flags.mark_flags_as_required(['folders', 'work', 'out'])

# The recipe docs/fine_tuning.md gives for a small folder, from scratch or fine-tuned, and
# what fine-tuning adds to it: the source run's convolutions and BatchNorms frozen.
RECIPE = ['--config.batch_size=25', '--config.num_epochs=5', '--config.schedule=cosine',
          '--config.warmup_epochs=1']
FINETUNE = ["--config.freeze=('conv', 'batch_norm')"]


def train(workdir: str, dataset: str, extra: list[str]) -> dict:
  """Runs main.py with configs/default.py on the image folder `dataset` and `extra` flags;
  returns the command, its wall time and each epoch's eval accuracy and loss and train
  accuracy."""
  args = [sys.executable, 'main.py', '--config=configs/default.py', f'--workdir={workdir}',
          '--config.data_source=folder', f'--config.dataset={dataset}',
          '--config.eval_split=test', *extra]
  child = harness.run_child(args, log_path=f'{workdir}.log')
  epochs = [values for values in harness.read_metrics(workdir) if 'eval/accuracy' in values]
  trained = [values for values in harness.read_metrics(workdir) if 'train/accuracy' in values]
  with open(f'{workdir}.log', encoding='utf-8') as log:
    head_renewed = 'its head (linear2.bias, linear2.kernel) starts fresh' in log.read()
  return {'command': shlex.join(['python', *args[1:]]), 'wall_s': round(child.seconds, 1),
          'eval_accuracy': [epoch['eval/accuracy'] for epoch in epochs],
          'eval_loss': [epoch['eval/loss'] for epoch in epochs],
          # Over the steps since the last write: the whole epoch where an epoch has fewer steps
          # than config.log_every_steps (every run here).
          'train_accuracy': [values['train/accuracy'] for values in trained],
          'head_renewed': head_renewed}


def draw(folders: str, size: int, seed: int) -> str:
  """A folder of `size` training images of each digit 5-9, drawn by `seed` from digits59's 50
  (hard links), and digits59's test images: its root."""
  source = os.path.join(folders, 'digits59')
  root = os.path.join(FLAGS.work, f'digits59_{size}_seed{seed}')
  rng = np.random.default_rng(seed)
  for digit in sorted(os.listdir(os.path.join(source, 'train'))):
    names = sorted(os.listdir(os.path.join(source, 'train', digit)))
    if size > len(names):
      raise app.UsageError(f'--sizes: digit {digit} has {len(names)} training images.')
    os.makedirs(os.path.join(root, 'train', digit))
    for name in rng.choice(names, size, replace=False):
      os.link(os.path.join(source, 'train', digit, name),
              os.path.join(root, 'train', digit, name))
  os.symlink(os.path.join(os.path.abspath(source), 'test'), os.path.join(root, 'test'))
  return root


def loss_rise(run: dict) -> float:
  """The eval loss after the last epoch over its lowest: how far it rose after its best epoch."""
  return run['eval_loss'][-1] / min(run['eval_loss'])


def main(argv):
  del argv
  shutil.rmtree(FLAGS.work, ignore_errors=True)
  os.makedirs(FLAGS.work)
  recipe = FLAGS.recipe if FLAGS.recipe is not None else RECIPE
  finetune = FLAGS.finetune if FLAGS.finetune is not None else FINETUNE
  pretrain = os.path.join(FLAGS.work, 'digits04')
  pretrained = train(pretrain, os.path.join(FLAGS.folders, 'digits04'),
                     [f'--config.num_epochs={FLAGS.pretrain_epochs}'])
  runs, summary = [], {}
  for size in map(int, FLAGS.sizes):
    for seed in map(int, FLAGS.seeds):
      dataset = draw(FLAGS.folders, size, seed)
      for arm, init in (('finetune', [*finetune, f'--config.init_from={pretrain}']),
                        ('scratch', [])):
        run = train(os.path.join(FLAGS.work, f'{arm}_{size}_seed{seed}'), dataset,
                    [*recipe, f'--config.seed={seed}', *init])
        runs.append({'arm': arm, 'size': size, 'seed': seed, **run})
        print(f'{size} a digit, {arm}, seed {seed}: eval accuracy by epoch '
              f'{", ".join(f"{value:.4f}" for value in run["eval_accuracy"])}; loss '
              f'{", ".join(f"{value:.3f}" for value in run["eval_loss"])}', flush=True)
    of_size = [run for run in runs if run['size'] == size]
    last = {arm: [run['eval_accuracy'][-1] for run in of_size if run['arm'] == arm]
            for arm in ('finetune', 'scratch')}
    summary[size] = {
        'mean_last_epoch': {arm: sum(values) / len(values) for arm, values in last.items()},
        'finetune_beats_scratch_every_seed': all(
            tuned > scratch for tuned, scratch in zip(last['finetune'], last['scratch'])),
        'largest_loss_rise_after_best_epoch': max(loss_rise(run) for run in of_size)}
  harness.write_json(FLAGS.out, {
      'pretrain': {'epochs': FLAGS.pretrain_epochs, **pretrained}, 'recipe': recipe,
      'finetune': finetune,
      'runs': runs, 'by_size': summary})


if __name__ == '__main__':
  app.run(main)

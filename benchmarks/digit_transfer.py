"""docs/fine_tuning.md's transfer table: digits 0-4 → 5-9 from 10, 20 or 50 images a digit,
fine-tuned from a run of this app against from scratch, on MNIST or on generated photos.

    python -m benchmarks.digit_transfer --mnist_folders=/tmp/mf --photo_folders=/tmp/photos \
      --work=/tmp/dt --seeds=0,1,2 --sizes=10,20,50 --out=docs/runs/digit_transfer.json
    python -m benchmarks.digit_transfer --table=docs/runs/digit_transfer.json  # The docs' table.
    python -m benchmarks.digit_transfer --kinds=backbone_mnist,backbone_photos \
      --mnist_folders=/tmp/mf --photo_folders=/tmp/photos --work=/tmp/dtb --seeds=0,1,2 \
      --sizes=10,20,50 --out=docs/runs/digit_transfer_backbone.json

The kinds (`KINDS`, `--kinds`): MNIST's digits as PNG folders with `configs/default.py`, photos
of digits in random colours and places, 200-260 px (`sample_folders`'s 'digits': 200 training
and 100 test photos a digit) with `configs/images.py`, each folder written on first use; and
'backbone_mnist', 'backbone_photos': the same folders with `configs/finetune.py`'s ResNet-18
(pretrained by this app: no weights can be downloaded here), fine-tuned and linearly probed.
For each kind: pretrain on digits 0-4 (scored on their test images); then for each size and
seed, draw `size` training images of each digit 5-9 and train on them with docs/fine_tuning.md's
small-folder recipe (the kind's, or `--recipe`) from scratch and from the source run
(`init_from`; `--finetune` adds flags, e.g. freezing; the head renewed, `head_renewed`), scored
on the test images of 5-9 after every epoch. Each run is `python main.py` in its own process,
read from its metrics.jsonl; `--out` is written after each kind (`harness.write_json`), with two
checks per kind and size: whether every seed's run from the source ends above its run from
scratch, and the largest rise of a run's eval loss after its best epoch (at most 2x is asked).
The docs' table is printed at the end, and by `--table` from the JSON.
"""

import json
import os
import shlex
import shutil
import sys
from typing import NamedTuple

from absl import app
from absl import flags
import numpy as np

from benchmarks import harness

FLAGS = flags.FLAGS
flags.DEFINE_list('kinds', ['mnist', 'photos'], 'Kinds of digit images (KINDS).')
flags.DEFINE_string('mnist_folders', None, 'Where MNIST as folders is (written on first use '
                    "from TFDS's MNIST).")
flags.DEFINE_string('photo_folders', None, 'Where the photos are (written on first use).')
flags.DEFINE_string('table', None, 'Print the table of this JSON artefact, and nothing else.')
flags.DEFINE_string('work', None, 'Where the runs\' workdirs and logs go (emptied first).')
flags.DEFINE_list('seeds', ['0'], 'The seeds of the digits 5-9 runs (config.seed) and of the '
                  'images drawn for them.')
flags.DEFINE_list('sizes', ['50'], 'Training images of each digit 5-9 (at most 50 for mnist).')
flags.DEFINE_list('arms', None, "Which runs to train (default: the kind's runs from the source, "
                  "and 'scratch').")
flags.DEFINE_integer('pretrain_epochs', None, "Epochs of the pretraining on digits 0-4 (the "
                     "kind's by default).")
flags.DEFINE_multi_string('recipe', None, 'A main.py flag of both arms of the digits 5-9 runs, '
                          "once per flag (default: the kind's recipe).")
flags.DEFINE_multi_string('finetune', [], 'A main.py flag of the fine-tuned arm alone, once '
                          "per flag, e.g. --finetune=--config.freeze=('conv',) (default: none).")
flags.DEFINE_string('out', None, 'The JSON file of the figures.')


class Kind(NamedTuple):
  """A kind of digit images: its config, its two folders' names (under --mnist_folders or
  --photo_folders, `folders`), the pretraining's epochs and flags, the recipe docs/fine_tuning.md
  gives for a small folder of it (flags of every digits 5-9 run), the runs started from the
  source (arm: their own flags) and the config and flags of the run from scratch (the config's
  own and the recipe by default)."""
  config: str
  folders: str
  source: str
  target: str
  pretrain_epochs: int
  recipe: list[str]
  pretrain: list[str] = []
  tuned: dict[str, list[str]] = {'finetune': []}
  scratch: tuple[str, list[str]] | None = None


_MNIST_RECIPE = ['--config.batch_size=25', '--config.num_epochs=5', '--config.schedule=cosine',
                 '--config.warmup_epochs=1']
# A pretrained backbone: configs/finetune.py's ResNet-18, pretrained by this app on digits 0-4
# (no weights can be downloaded here), fine-tuned and probed on a tiny folder of 5-9, against
# the small-folder recipe from scratch (docs/small_folders.md; MNIST's: the 'mnist' kind's).
# Images are cut small for a 2-core CPU (56 and 112 px, not 224) and standardised as the
# small-folder recipe does (a photo's colours are random); eval scores part of the test images
# (ordered by a hash of their path) after every epoch of every run, for the loss and accuracy
# alone (configs/finetune.py's other evaluators write reports, pictures and a confusion matrix:
# nothing the table reads).
# 30 epochs: at 10 (4-16 steps an epoch) fine-tuning ended below the scratch recipe at 50 a
# digit (docs/runs/digit_transfer_backbone_10_epochs.json), still learning at its last epoch.
_BACKBONE = ['--config.batch_size=16', '--config.num_epochs=30']
_PROBE = {'finetune': [], 'probe': ['--config.linear_probe=True', '--config.learning_rate=0.01']}
_STANDARDIZE = 'standardize(per_channel=True, polarity=True)'
_MNIST_BACKBONE = [f'--config.preprocess=resize(56)|translate(4)|{_STANDARDIZE}',
                   '--config.eval_split=test[:20%]', '--config.evaluators=loss|accuracy']
_PHOTOS_BACKBONE = [f'--config.preprocess=resize(112)|translate(8)|{_STANDARDIZE}',
                    '--config.eval_split=test[:50%]', '--config.evaluators=loss|accuracy']
KINDS = {
    'mnist': Kind('configs/default.py', 'mnist_folders', 'digits04', 'digits59', 2,
                  _MNIST_RECIPE),
    'photos': Kind('configs/images.py', 'photo_folders', 'photos04', 'photos59', 20, []),
    'backbone_mnist': Kind(
        'configs/finetune.py', 'mnist_folders', 'digits04', 'digits59', 5,
        [*_MNIST_BACKBONE, *_BACKBONE], tuned=_PROBE,
        pretrain=[*_MNIST_BACKBONE, '--config.train_split=train[:10%]',
                  '--config.learning_rate=0.001'],
        scratch=('configs/default.py', [*_MNIST_RECIPE, *_MNIST_BACKBONE[1:]])),
    'backbone_photos': Kind(
        'configs/finetune.py', 'photo_folders', 'photos04', 'photos59', 10,
        [*_PHOTOS_BACKBONE, *_BACKBONE], tuned=_PROBE,
        pretrain=[*_PHOTOS_BACKBONE, '--config.learning_rate=0.001'],
        scratch=('configs/images.py', _PHOTOS_BACKBONE[1:])),
}
PHOTO_SIZES = (200, 260)  # Height and width of the generated photos, each drawn in this range.
PHOTOS_PER_DIGIT = {'train': 200, 'test': 100}


def write_mnist_folders(root: str) -> None:
  """MNIST as PNG folders (`<root>/<dataset>/<split>/<digit>/<split>_<index>.png`): digits04,
  the training and test images of digits 0-4; digits59, 50 training images of each digit 5-9
  (drawn with seed 0) and all test images of 5-9."""
  # pylint: disable=g-import-not-at-top  (only here)
  from PIL import Image
  import tensorflow_datasets as tfds
  # pylint: enable=g-import-not-at-top
  train_split, test_split = (tfds.as_numpy(tfds.load('mnist', split=split, batch_size=-1))
                             for split in ('train', 'test'))
  rng = np.random.default_rng(0)
  chosen = set().union(*(rng.choice(np.flatnonzero(train_split['label'] == digit), 50,
                                    replace=False) for digit in range(5, 10)))
  for split, data in (('train', train_split), ('test', test_split)):
    for index, (image, label) in enumerate(zip(data['image'], data['label'])):
      if label >= 5 and split == 'train' and index not in chosen:
        continue
      folder = os.path.join(root, 'digits04' if label < 5 else 'digits59', split, str(label))
      os.makedirs(folder, exist_ok=True)
      Image.fromarray(image[..., 0]).save(os.path.join(folder, f'{split}_{index}.png'))


def write_photo_folders(root: str) -> None:
  """Photos of digits (`sample_folders.make_kind_folder`'s 'digits') in `root`/photos04
  (digits 0-4) and `root`/photos59 (5-9), each with PHOTOS_PER_DIGIT of every digit in train/
  and test/, the splits drawn by seeds 0 and 1."""
  import sample_folders  # pylint: disable=g-import-not-at-top  (PIL, only here)
  staging = os.path.join(root, 'all')
  for seed, (split, count) in enumerate(PHOTOS_PER_DIGIT.items()):
    sample_folders.make_kind_folder(staging, 'digits', seed=seed, num_images=10 * count,
                                    image_sizes=PHOTO_SIZES, messy=False, split=split)
    for digit in range(10):
      target = os.path.join(root, 'photos04' if digit < 5 else 'photos59', split)
      os.makedirs(target, exist_ok=True)
      os.rename(os.path.join(staging, split, str(digit)), os.path.join(target, str(digit)))
  shutil.rmtree(staging)


def train(workdir: str, config: str, dataset: str, extra: list[str]) -> dict:
  """Runs main.py with `config` on the image folder `dataset` (trained on its train/, scored on
  its test/) and `extra` flags; returns the command, its wall time and each epoch's eval
  accuracy and loss and train accuracy."""
  args = [sys.executable, 'main.py', f'--config={config}', f'--workdir={workdir}',
          '--config.data_source=folder', f'--config.dataset={dataset}',
          '--config.train_split=train', '--config.eval_split=test', *extra]
  child = harness.run_child(args, log_path=f'{workdir}.log')
  metrics = harness.read_metrics(workdir)
  epochs = [values for values in metrics if 'eval/accuracy' in values]
  with open(f'{workdir}.log', encoding='utf-8') as log:
    head_renewed = 'starts fresh' in log.read()
  return {'command': shlex.join(['python', *args[1:]]), 'wall_s': round(child.seconds, 1),
          'eval_accuracy': [epoch['eval/accuracy'] for epoch in epochs],
          'eval_loss': [epoch['eval/loss'] for epoch in epochs],
          # Over the steps since the last write: the whole epoch where an epoch has fewer steps
          # than config.log_every_steps (every run on digits 5-9).
          'train_accuracy': [values['train/accuracy'] for values in metrics
                             if 'train/accuracy' in values],
          'head_renewed': head_renewed}


def draw(source: str, size: int, seed: int) -> str:
  """A folder of `size` training images of each digit of `source`, drawn by `seed` (hard links),
  and `source`'s test images: its root."""
  root = os.path.join(FLAGS.work, f'{os.path.basename(source)}_{size}_seed{seed}')
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


def run_kind(name: str) -> dict:
  """Pretrains kind `name` on digits 0-4, then trains each size, seed and arm on digits 5-9:
  the runs and the checks of each size."""
  kind = KINDS[name]
  folders = FLAGS[kind.folders].value
  if not folders:
    raise app.UsageError(f'--{kind.folders} is needed for the kind {name}.')
  if not os.path.isdir(os.path.join(folders, kind.source)):
    (write_photo_folders if kind.folders == 'photo_folders' else write_mnist_folders)(folders)
  recipe = FLAGS.recipe if FLAGS.recipe is not None else kind.recipe
  pretrain_epochs = FLAGS.pretrain_epochs or kind.pretrain_epochs
  pretrain = os.path.join(FLAGS.work, kind.source)
  pretrained = train(pretrain, kind.config, os.path.join(folders, kind.source),
                     [*kind.pretrain, f'--config.num_epochs={pretrain_epochs}'])
  arms = {**{arm: (kind.config, [*recipe, *flags_, *FLAGS.finetune,
                                 f'--config.init_from={pretrain}'])
             for arm, flags_ in kind.tuned.items()},
          'scratch': kind.scratch or (kind.config, recipe)}
  arms = {arm: arms[arm] for arm in FLAGS.arms or arms}
  runs, summary = [], {}
  for size in map(int, FLAGS.sizes):
    for seed in map(int, FLAGS.seeds):
      dataset = draw(os.path.join(folders, kind.target), size, seed)
      for arm, (config, extra) in arms.items():
        run = train(os.path.join(FLAGS.work, f'{name}_{arm}_{size}_seed{seed}'), config,
                    dataset, [*extra, f'--config.seed={seed}'])
        runs.append({'arm': arm, 'size': size, 'seed': seed, **run})
        print(f'{name}, {size} a digit, {arm}, seed {seed}: eval accuracy by epoch '
              f'{", ".join(f"{value:.4f}" for value in run["eval_accuracy"])}', flush=True)
    of_size = [run for run in runs if run['size'] == size]
    last = {arm: [run['eval_accuracy'][-1] for run in of_size if run['arm'] == arm]
            for arm in arms}
    summary[size] = {
        'mean_last_epoch': {arm: sum(values) / len(values) for arm, values in last.items()},
        **{f'{arm}_beats_scratch_every_seed': all(
            tuned > scratch for tuned, scratch in zip(last[arm], last['scratch']))
           for arm in arms if arm != 'scratch' and 'scratch' in arms},
        'largest_loss_rise_after_best_epoch': max(loss_rise(run) for run in of_size)}
  return {'config': kind.config, 'scratch': arms.get('scratch'),
          'pretrain': {'epochs': pretrain_epochs, **pretrained}, 'recipe': recipe,
          'finetune': FLAGS.finetune, 'runs': runs, 'by_size': summary}


def table(results: dict[str, dict]) -> str:
  """docs/fine_tuning.md's table of `results` (the JSON's 'kinds'): by kind, size and run from
  the source (fine-tuned, probed), each seed's accuracy after the last epoch, and from scratch,
  their means, whether the run from the source is ahead on every seed, and the largest rise of
  a run's eval loss after its best epoch (over all the size's runs)."""
  rows = []
  for name, result in results.items():
    for size, checks in result['by_size'].items():
      means = checks['mean_last_epoch']

      def last(arm):
        return ', '.join(f"{run['eval_accuracy'][-1]:.1%}" for run in result['runs']
                         if run['arm'] == arm and str(run['size']) == str(size))
      for arm in [arm for arm in means if arm != 'scratch']:
        ahead = checks.get(f'{arm}_beats_scratch_every_seed')
        rows.append([name, size, arm, last(arm), f'{means[arm]:.1%}', last('scratch'),
                     f"{means['scratch']:.1%}" if 'scratch' in means else '',
                     '' if ahead is None else 'yes' if ahead else 'no',
                     f"{checks['largest_loss_rise_after_best_epoch']:.2f}x"])
  return harness.markdown_table(
      ['kind', 'images a digit', 'run', 'by seed', 'mean', 'from scratch, by seed', 'mean',
       'ahead of scratch on every seed', 'largest eval-loss rise after the best epoch'], rows,
      align='lrllrlrlr')


def main(argv):
  del argv
  if FLAGS.table:
    with open(FLAGS.table, encoding='utf-8') as file:
      print(table(json.load(file)['kinds']))
    return
  if not FLAGS.work or not FLAGS.out:
    raise app.UsageError('--work and --out are needed.')
  shutil.rmtree(FLAGS.work, ignore_errors=True)
  os.makedirs(FLAGS.work)
  results = {}
  for name in FLAGS.kinds:
    results[name] = run_kind(name)
    harness.write_json(FLAGS.out, {'kinds': results})
  print(table(results))


if __name__ == '__main__':
  app.run(main)

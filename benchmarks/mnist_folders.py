"""Writes MNIST as image folders for the fine-tuning and class-weight experiments.

    python -m benchmarks.mnist_folders --out=/tmp/mf [--data_dir=$TFDS_DATA_DIR]

One PNG per image, `<out>/<dataset>/<split>/<digit>/<split>_<index>.png`:
  digits04: the training and test images of digits 0-4 (pretraining);
  digits59: 50 training images of each digit 5-9 (drawn with seed 0), all test images of 5-9;
  rare3:    every training image, but digit 3 keeps 5% of its own (drawn with seed 0); all test
            images.
docs/fine_tuning.md has the runs on them.
"""

import os

from absl import app
from absl import flags
import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

FLAGS = flags.FLAGS
flags.DEFINE_string('out', None, 'Where to write the folders.')
flags.DEFINE_string('data_dir', None, 'TFDS data dir with MNIST (default: TFDS\'s).')
flags.mark_flag_as_required('out')


def _write(root: str, split: str, images: np.ndarray, labels: np.ndarray, keep) -> None:
  for index, (image, label) in enumerate(zip(images, labels)):
    if keep(index, int(label)):
      folder = os.path.join(root, split, str(label))
      os.makedirs(folder, exist_ok=True)
      Image.fromarray(image[..., 0]).save(os.path.join(folder, f'{split}_{index}.png'))


def main(argv):
  del argv
  train, test = (tfds.as_numpy(tfds.load('mnist', split=split, batch_size=-1,
                                         data_dir=FLAGS.data_dir)) for split in ('train', 'test'))
  rng = np.random.default_rng(0)
  out = FLAGS.out
  _write(f'{out}/digits04', 'train', train['image'], train['label'], lambda i, l: l < 5)
  _write(f'{out}/digits04', 'test', test['image'], test['label'], lambda i, l: l < 5)
  chosen = {digit: set(rng.choice(np.flatnonzero(train['label'] == digit), 50, replace=False))
            for digit in range(5, 10)}
  _write(f'{out}/digits59', 'train', train['image'], train['label'],
         lambda i, l: l >= 5 and i in chosen[l])
  _write(f'{out}/digits59', 'test', test['image'], test['label'], lambda i, l: l >= 5)
  threes = np.flatnonzero(train['label'] == 3)
  kept = set(rng.choice(threes, int(0.05 * len(threes)), replace=False))
  _write(f'{out}/rare3', 'train', train['image'], train['label'],
         lambda i, l: l != 3 or i in kept)
  _write(f'{out}/rare3', 'test', test['image'], test['label'], lambda i, l: True)


if __name__ == '__main__':
  app.run(main)

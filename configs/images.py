"""A recipe for your own small folder of images (hundreds to a few thousand), default CNN.

  python main.py --config=configs/images.py --workdir=runs/mine --config.dataset=/path/to/root

`root/train/<class name>/<image>`; the last 10% of `train` (files ordered by a hash of their
path, so every class is in both parts) is held out and evaluated after every epoch. The
default config's 128-image batches give a few hundred images only ~6 steps an epoch, and its
SGD at a constant 0.1 ends its 10 epochs still noisy; this recipe makes ~10x more updates:
batches of 32, 20 epochs, Adam at 1e-3 with one warm-up epoch and a cosine decay, and mild
augmentation that keeps any class (left-right flips, shifts of up to 2 pixels). It also sets
the image size, since the folder's images may differ in size and the CNN flattens its last
feature map into a dense layer: 32x32 (that layer: 1M weights). For larger images or finer
detail give the whole preprocessing, keeping the augmentation, e.g.
`--config.preprocess='resize(64)|flip_lr|translate(4)'` (a bare `resize(64)` turns it off);
drop `flip_lr` where mirroring changes the class (text, digits, arrows).

Measured on generated folders of 3 classes of drawn shapes (circle, square, triangle, 48x48
RGB, 300 a class: 810 training images, 90 held out), held-out accuracy at the last epoch for
seeds 0 / 1 / 2, about 1 min a run on a shared 2-core CPU (500 steps):

| folder | default config (10 epochs) | this recipe |
| --- | --- | --- |
| shapes lighter than the background | 91.1% / 90.0% / 94.4% | 97.8% / 100% / 100% |
| the same, another generator seed | - | 97.8% / 100% / 98.9% |
| either polarity (harder) | - | 96.7% / 98.9% / 97.8% |

SGD (momentum 0.9, 0.1, same schedule and augmentation) scored 100% on all three seeds of the
first folder but stalled at 65.6% on one seed of the harder one; Adam without the augmentation
overfitted (91.1%, seed 0); on seed 0 of the first folder, batches of 128 (20 epochs) reached
93.3% and 10 epochs (batches of 32) 92.2%. With 90 held-out images one image is 1.1%.

It does not hold where the class is a shape, texture or digit drawn in random colours at random
positions and sizes (`tests/image_folders.make_kind_folder`, `benchmarks/small_folders.py`): on
4 generated shape classes (seed 0) it ends at 65.3% training and 51.0% held-out accuracy; the
diagnosis so far is in docs/small_folders.md.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.data_source = 'folder'  # --config.dataset=/path/to/root
  config.train_split = 'train[:90%]'
  config.eval_split = 'train[90%:]'
  config.preprocess = 'resize(32)|flip_lr|translate(2)'
  config.batch_size = 32
  config.num_epochs = 20
  config.optimizer = 'adam'
  config.learning_rate = 0.001
  config.schedule = 'cosine'
  config.warmup_epochs = 1.0
  return config

"""A recipe for your own small folder of images (hundreds to a few thousand).

  python main.py --config=configs/images.py --workdir=runs/mine --config.dataset=/path/to/root

`root/train/<class name>/<image>`; the last 10% of `train` (files ordered by a hash of their
path, so every class is in both parts) is held out and evaluated after every epoch.

The recipe: images stretched to 32x32, shifted by up to 3 pixels in training, then each image
standardised per channel with its sign set by its skew (`standardize(per_channel=True,
polarity=True)`: a figure's values are the same whatever its two colours and whichever is
lighter); a small ResNet (`cifar_resnet`, widths 16-32-64, one block a stage: 8 layers, 0.08M
weights) whose global average pooling sees a figure anywhere alike; Adam at 3e-3, batches of
32, one warm-up epoch then a cosine decay over 60 epochs (1,680 steps for 900 images: a few
minutes on 2 CPU cores). For larger images or finer detail give
the whole preprocessing, e.g. `--config.preprocess='resize(64)|translate(6)|standardize(
per_channel=True, polarity=True)'`; add `flip_lr` where mirroring keeps the class (not text,
digits, arrows); drop `polarity=True` (or the whole op, for `normalize('imagenet')`) where
colour or brightness carries the class.

Why, and what it holds out on generated folders of shapes, textures and digits in random
colours at random places: docs/small_folders.md. Standardising each channel, then fixing its
polarity, lets the network learn the figure rather than the flat colours; global average
pooling sees it anywhere alike; at 20 epochs it underfit, at 60 it fits.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.data_source = 'folder'  # --config.dataset=/path/to/root
  config.train_split = 'train[:90%]'
  config.eval_split = 'train[90%:]'
  # Colours and polarity divided out per image: see the docstring and docs/small_folders.md.
  config.preprocess = 'resize(32)|translate(3)|standardize(per_channel=True, polarity=True)'
  # Global average pooling: a figure anywhere in the image is the same figure.
  config.model = 'cifar_resnet'
  config.model_options.cifar_resnet.widths = (16, 32, 64)
  config.model_options.cifar_resnet.blocks_per_stage = 1
  config.batch_size = 32
  config.num_epochs = 60
  config.optimizer = 'adam'
  config.learning_rate = 0.003
  config.schedule = 'cosine'
  config.warmup_epochs = 1.0
  return config

"""CIFAR-10 recipe: ResNet-20 on 32x32 colour images, cropped, flipped and randomly erased, with
CutMix, SGD with L2 weight decay, linear warm-up then cosine decay.

The classic ResNet-20 set-up (He et al. 2016: SGD 0.1, momentum 0.9, batch 128, random crops
with 4-pixel padding and horizontal flips), with cosine decay over 30 epochs instead of 160
epochs of step decay, and two regularisers of later recipes (random erasing, Zhong et al. 2020;
CutMix, Yun et al. 2019). Its accuracy on real CIFAR-10 has not been measured here (the data cannot
be downloaded on this machine); the tests check that it trains on a small generated colour
dataset. For other 32x32 colour data, e.g. an image folder:

    python main.py --config=configs/cifar10.py --workdir=runs/mine \
      --config.data_source=folder --config.dataset=/path/to/root \
      --config.preprocess='resize(32)|random_crop(32, pad=4)|flip_lr|random_erasing(0.25)'
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.dataset = 'cifar10'
  config.shuffle_buffer_size = 50_000  # The whole training split: a perfect shuffle.
  config.preprocess = 'random_crop(32, pad=4)|flip_lr|random_erasing(0.25)'
  config.cutmix_alpha = 1.0
  config.model = 'cifar_resnet'
  config.optimizer = 'sgd_l2'
  config.learning_rate = 0.1
  config.optimizer_options.sgd_l2 = {'momentum': 0.9, 'weight_decay': 5e-4}
  config.schedule = 'cosine'
  config.warmup_epochs = 1.0
  config.batch_size = 128
  config.num_epochs = 30
  return config

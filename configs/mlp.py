"""The classic pure-JAX MLP recipe: a 784-512-512-10 MLP, plain SGD at 0.01, batch 128, 8 epochs."""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model = 'mlp'
  config.optimizer = 'sgd'
  config.learning_rate = 0.01
  config.momentum = 0.0  # Plain SGD.
  config.batch_size = 128
  config.num_epochs = 8
  return config

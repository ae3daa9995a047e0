"""The classic pure-JAX MLP recipe: a 784-512-512-10 MLP, plain SGD at 0.01, batch 128, 8 epochs.

As in the JAX docs notebook "Training a simple neural network, with PyTorch data loading": raw
pixel values 0-255 as inputs (input_scale=255 on the [0, 1] pixels) and every weight and bias
drawn from N(0, 0.01^2). With [0, 1] inputs and Flax's default init, the same SGD step is far
smaller (93.09% after 8 epochs instead of the notebook's 96.72%).
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.model = 'mlp'
  config.optimizer = 'sgd'
  config.learning_rate = 0.01
  config.optimizer_options.sgd.momentum = 0.0  # Plain SGD.
  config.batch_size = 128
  config.num_epochs = 8
  config.model_options.mlp.input_scale = 255.0
  config.model_options.mlp.init_stddev = 0.01
  return config

"""Export for serving: the latest checkpoint's model, in eval mode, as a TF SavedModel.

The model is converted with `jax2tf`; its weights (Params and BatchStats) become TF variables.
The SavedModel's `serving_default` signature (and its `predict` function) map float32 images in
[0, 1] of shape (batch, height, width, channels) to logits (batch, num_classes).
"""

import os

from absl import logging
from flax import nnx
from jax.experimental import jax2tf
import ml_collections
import numpy as np
import tensorflow as tf

import data_sources
from training import checkpointing
from training import config_checks

EXPORT_DIR = 'export'


def export_saved_model(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Writes the latest checkpoint's model to `<workdir>/export`; returns that path."""
  config_checks.check_config(config)
  info = data_sources.open_source(config).info(config)
  model, step = checkpointing.load_latest_model(config, workdir, info)
  graphdef, weights, rest = nnx.split(model, (nnx.Param, nnx.BatchStat), ...)

  def predict(weights, images):
    return nnx.merge(graphdef, nnx.State(weights), rest)(images)

  module = tf.Module()
  module.weights = tf.nest.map_structure(lambda x: tf.Variable(np.asarray(x), trainable=False),
                                         nnx.to_pure_dict(weights))
  converted = jax2tf.convert(predict, polymorphic_shapes=[None, '(batch, ...)'],
                             with_gradient=False)
  module.predict = tf.function(
      lambda images: converted(module.weights, images), autograph=False,
      input_signature=[tf.TensorSpec((None, *info.image_shape), tf.float32, name='images')])
  path = os.path.join(os.path.abspath(workdir), EXPORT_DIR)
  tf.saved_model.save(module, path, signatures={'serving_default': module.predict})
  logging.info('Exported the model of the checkpoint at step %d to %s.', step, path)
  print(f'Exported the model of step {step} as a TF SavedModel to {path}')
  return path

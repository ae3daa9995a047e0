"""Export for serving: the latest checkpoint's model, in eval mode, as a TF SavedModel.

The model is converted with `jax2tf`; its weights (Params and BatchStats) become TF variables.
Signatures, all taking float32 images in [0, 1] of shape (batch, height, width, channels),
resized to the model's input size:
  serving_default (and the `predict` function): logits (batch, num_classes);
  classify: {'class': the predicted class names, 'probability': their softmax probabilities};
  class_names (no input): {'class_names': every class name, in label order}.
"""

import os

from absl import logging
from flax import nnx
from jax.experimental import jax2tf
import ml_collections
import numpy as np
import tensorflow as tf

from modes import predict as predict_mode
from training import checkpointing

EXPORT_DIR = 'export'


def export_saved_model(config: ml_collections.ConfigDict, workdir: str,
                       checkpoint: str = 'latest') -> str:
  """Writes a checkpoint's model (--checkpoint) to `<workdir>/export`; returns that path."""
  info = predict_mode.checked_workdir_info(config, workdir)
  model, step = checkpointing.load_model(config, workdir, info, checkpoint)
  graphdef, weights, rest = nnx.split(model, (nnx.Param, nnx.BatchStat), ...)

  def predict(weights, images):
    return nnx.merge(graphdef, nnx.State(weights), rest)(images)

  module = tf.Module()
  module.weights = tf.nest.map_structure(lambda x: tf.Variable(np.asarray(x), trainable=False),
                                         nnx.to_pure_dict(weights))
  converted = jax2tf.convert(predict, polymorphic_shapes=[None, '(batch, ...)'],
                             with_gradient=False)
  images_spec = tf.TensorSpec((None, *info.image_shape), tf.float32, name='images')
  module.predict = tf.function(lambda images: converted(module.weights, images), autograph=False,
                               input_signature=[images_spec])
  names = tf.constant(info.class_names)

  def classify(images):
    probabilities = tf.nn.softmax(module.predict(images))
    return {'class': tf.gather(names, tf.argmax(probabilities, axis=-1)),
            'probability': tf.reduce_max(probabilities, axis=-1)}

  module.classify = tf.function(classify, autograph=False, input_signature=[images_spec])
  module.class_names = tf.function(lambda: {'class_names': names}, autograph=False,
                                   input_signature=[])
  path = os.path.join(os.path.abspath(workdir), EXPORT_DIR)
  tf.saved_model.save(module, path, signatures={'serving_default': module.predict,
                                                'classify': module.classify,
                                                'class_names': module.class_names})
  logging.info('Exported the model of the checkpoint at step %d to %s.', step, path)
  print(f'Exported the model of step {step} as a TF SavedModel to {path}')
  return path

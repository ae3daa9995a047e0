"""Export for serving: a checkpoint's model, in eval mode, with its preprocessing, as a TF
SavedModel in `<workdir>/export`, which a user with TensorFlow alone can run.

The model is converted with `jax2tf`; its weights (Params and BatchStats) become TF variables.
In front of it, the deterministic part of `config.preprocess` (resize, then scale), the same TF
ops that training and `--mode=predict` run. Signatures:
  serving_default (and `predict`): `images`, uint8 (batch, height, width, channels) pixels 0-255
    of any size (one size per call) -> `logits` (batch, num_classes);
  classify: the same input -> {'class': the predicted class names, 'probability': their
    softmax probabilities};
  class_names (no input): {'class_names': every class name, in label order}.
"""

import os

from absl import logging
from flax import nnx
import jax
from jax.experimental import jax2tf
import numpy as np
import tensorflow as tf

import modes
from training import run_spec

EXPORT_DIR = 'export'


def export_saved_model(run: run_spec.Run, workdir: str, checkpoint: str = 'latest') -> str:
  """Writes a checkpoint's model (--checkpoint) to `<workdir>/export`; returns that path."""
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)
  preprocess = run.input.preprocess
  height, width, channels = info.image_shape
  graphdef, weights, rest = nnx.split(model, (nnx.Param, nnx.BatchStat), ...)

  def logits(weights, images):
    return nnx.merge(graphdef, nnx.State(weights), rest)(images).astype(jax.numpy.float32)

  module = tf.Module()
  module.weights = tf.nest.map_structure(lambda x: tf.Variable(np.asarray(x), trainable=False),
                                         nnx.to_pure_dict(weights))
  converted = jax2tf.convert(logits, polymorphic_shapes=[None, '(batch, ...)'],
                             with_gradient=False)
  images_spec = tf.TensorSpec((None, None, None, channels), tf.uint8, name='images')

  def predict(images):
    resized = tf.ensure_shape(preprocess.resize(images, (height, width)),
                              (None, height, width, channels))
    return {'logits': converted(module.weights, preprocess.eval_batch(resized))}

  module.predict = tf.function(predict, autograph=False, input_signature=[images_spec])
  names = tf.constant(info.class_names)

  def classify(images):
    probabilities = tf.nn.softmax(module.predict(images)['logits'])
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
  print(f'Exported the model of step {step} as a TF SavedModel to {path}. It takes uint8 '
        f'images (batch, height, width, {channels}), pixels 0-255, of any size, resized to '
        f'{height}x{width} as in training (config.preprocess={preprocess.spec!r}); '
        "signatures: serving_default (logits), classify (class names), class_names.")
  return path

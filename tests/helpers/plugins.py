"""One plug-in of each kind, in one file outside the app's tree, as a user adds them: a model, a
data source, a preprocessing op, a loss, an optimizer, an evaluator, a logger and an export
format. Importing this module registers them; nothing in the app names them
(tests/test_plugins.py trains and exports with them).
"""

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import default
import data_sources
from data_sources import base
import evaluators
import models
from modes import export
import preprocessing
from training import loggers
from training import losses
from training import optimizers

LOG_FILE = 'scalars_for_test.jsonl'


@models.MODELS.register('tiny_for_test')
class TinyNet(nnx.Module):
  """What a user adds: one class, built from the injected layers, with one option."""

  def __init__(self, image_shape, num_classes, *, layers, rngs, width=4):
    self.conv = layers.conv(image_shape[-1], width, kernel_size=(3, 3), rngs=rngs)
    self.linear = layers.linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    return self.linear(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


@data_sources.SOURCES.register('stripes_for_test')
def stripes(name, data_dir, *, size=8, per_split=64):
  """Horizontal (label 0) or vertical (label 1) stripes of random phase, in memory."""
  del data_dir
  if size < 4:
    raise ValueError(f'size={size} must be at least 4')

  def load_range(split, part):
    rng = np.random.default_rng(0 if split == 'train' else 1)
    labels = rng.integers(0, 2, per_split)
    phases = rng.integers(0, 2, per_split)
    rows = (np.arange(size)[:, None] + phases[:, None, None]) % 2  # (n, size, 1)
    horizontal = np.broadcast_to(rows, (per_split, size, size))
    images = np.where(labels[:, None, None] == 0, horizontal, horizontal.transpose(0, 2, 1))
    return base.to_split(np.uint8(images * 255)[part], labels[part])

  return base.RangeSource(name, {'train': per_split, 'test': per_split}, 2, load_range,
                          class_names=('horizontal', 'vertical'))


@preprocessing.OPS.register('invert_for_test', stage='random')
def invert(probability=0.5):
  """Inverts each image with `probability`."""
  def op(images, seed):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    flip = tf.random.stateless_uniform(tf.shape(images)[:1], seed) < probability
    return tf.where(flip[:, None, None, None], 1.0 - images, images)
  return op


@losses.LOSSES.register('squared_for_test')
def squared(num_classes, class_counts, *, scale=1.0):
  del class_counts  # Not needed.
  """A Brier score: the squared distance of the softmax from the targets."""
  def loss(logits, targets):
    return scale * ((jax.nn.softmax(logits) - losses.soft_targets(targets, num_classes))**2).sum(-1)
  return loss


@evaluators.EVALUATORS.register('mean_confidence_for_test')
class MeanConfidence(evaluators.Evaluator):
  """The mean top softmax probability: `mean_confidence`."""
  name = 'mean_confidence'
  directions = {'mean_confidence': True}

  def init(self, info):
    return {'sum': jnp.zeros(()), 'count': jnp.zeros((), jnp.int32)}

  def update(self, state, logits, batch):
    top = jax.nn.softmax(logits).max(axis=-1)
    return {'sum': state['sum'] + jnp.where(batch['mask'], top, 0).sum(),
            'count': state['count'] + batch['mask'].sum(dtype=jnp.int32)}

  def results(self, state, info):
    return {'mean_confidence': float(state['sum'] / state['count'])}


@optimizers.OPTIMIZERS.register('sign_sgd_for_test')
def sign_sgd(learning_rate, *, momentum=0.0):
  """SGD on the signs of the gradients."""
  return optax.chain(optax.scale_by_sign(), optax.sgd(learning_rate, momentum=momentum or None))


def stripes_config():
  """A config that trains with one plug-in of each kind, from its values alone."""
  config = default.get_config()
  config.update(data_source='stripes_for_test', dataset='stripes', eval_split='test',
                model='tiny_for_test', loss='squared_for_test', optimizer='sign_sgd_for_test',
                preprocess='invert_for_test(0.5)', learning_rate=0.02, batch_size=16,
                eval_batch_size=32, num_epochs=8, log_every_steps=4,
                evaluators='loss|accuracy|mean_confidence_for_test',
                loggers='jsonl|scalars_for_test',
                best_metric='eval/mean_confidence')
  config.data_source_options.stripes_for_test = {'size': 8}
  config.model_options.tiny_for_test = {'width': 8}
  config.loss_options.squared_for_test = {'scale': 2.0}
  config.optimizer_options.sign_sgd_for_test = {'momentum': 0.5}
  return config


@loggers.LOGGERS.register('scalars_for_test')
class ScalarsLog(loggers.Writer):
  """Every scalar as one JSON line `{"step": ..., "name": ..., "value": ...}` in `filename`."""

  def __init__(self, workdir: str, filename: str = LOG_FILE):
    self._path = os.path.join(workdir, filename)

  def write_scalars(self, step, scalars):
    with open(self._path, 'a', encoding='utf-8') as file:
      for name, value in scalars.items():
        file.write(json.dumps({'step': int(step), 'name': name, 'value': float(value)}) + '\n')


@export.FORMATS.register('cpu_stablehlo_for_test')
class CpuStableHLO(export.Format):
  """`jax.export`'s serialized StableHLO lowered for the CPU alone, model-size images."""
  directory = 'export_cpu_stablehlo_for_test'
  file = 'model.bin'
  usage = "jax.export.deserialize(open(path, 'rb').read()).call(images)"

  def write(self, classifier, path):
    batch, = jax.export.symbolic_shape('batch')
    exported = jax.export.export(jax.jit(classifier.closed), platforms=('cpu',))(
        classifier.images_spec(batch))
    with open(path, 'wb') as file:
      file.write(exported.serialize())

  def run(self, path, images):
    with open(path, 'rb') as file:
      return np.asarray(jax.export.deserialize(file.read()).call(images))

  def card_fields(self, classifier, path):
    del path
    return {'platforms': ['cpu'], 'classes': len(classifier.info.class_names)}

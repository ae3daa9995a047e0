"""The reference to beat: the official Flax NNX MNIST example's training loop, as published.

Kept only so that `python -m benchmarks.benchmark --reference` can measure it side by side with
this project on the same machine: the same CNN with `nnx.Dropout` (bernoulli masks) and
reduce-window average pooling, SGD lr 0.1 momentum 0.9, batch 128, tf.data map ->
shuffle(1024) -> batch -> prefetch(1), a Python loop calling an `nnx.jit` step per batch,
`nnx.MultiMetric`, and per-epoch evaluation on `drop_remainder` test batches (9,984 of the
10,000 images).
"""

import functools

from flax import nnx
import optax
import tensorflow as tf
import tensorflow_datasets as tfds


class ReferenceCNN(nnx.Module):
  """The example's CNN, layer for layer."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x)))
    return self.linear2(x)


def loss_fn(model, batch):
  logits = model(batch['image'])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()
  return loss, logits


@nnx.jit
def train_step(model, optimizer, metrics, batch):
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])
  optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])


def datasets(data_dir, batch_size=128, test_split='test'):
  """The example's pipeline: map -> shuffle(1024) -> batch(drop_remainder) -> prefetch(1); the
  example evaluates all of 'test'."""
  tf.random.set_seed(0)
  normalize = lambda sample: {'image': tf.cast(sample['image'], tf.float32) / 255,
                              'label': sample['label']}
  train = tfds.load('mnist', split='train', data_dir=data_dir).map(normalize)
  test = tfds.load('mnist', split=test_split, data_dir=data_dir).map(normalize)
  train = train.shuffle(1024).batch(batch_size, drop_remainder=True).prefetch(1)
  test = test.batch(batch_size, drop_remainder=True).prefetch(1)
  return train, test


def create(seed=0):
  model = ReferenceCNN(rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average('loss'))
  return model, optimizer, metrics


def evaluate(model, metrics, test) -> dict[str, float]:
  model.eval()
  metrics.reset()
  for batch in test.as_numpy_iterator():
    eval_step(model, metrics, batch)
  model.train()
  return {name: float(value) for name, value in metrics.compute().items()}


def train_and_report(data_dir: str | None, num_epochs: int) -> None:
  """Trains like the example and prints one line per epoch: `epoch N eval_accuracy A`."""
  train, test = datasets(data_dir)
  model, optimizer, metrics = create()
  for epoch in range(1, num_epochs + 1):
    for batch in train.as_numpy_iterator():
      train_step(model, optimizer, metrics, batch)
    print(f'epoch {epoch} eval_accuracy {evaluate(model, metrics, test)["accuracy"]:.4f}',
          flush=True)


if __name__ == '__main__':
  from absl import app, flags  # pylint: disable=g-import-not-at-top,g-multiple-import
  flags.DEFINE_string('data_dir', None, 'TFDS data dir (default: $TFDS_DATA_DIR).')
  flags.DEFINE_integer('num_epochs', 10, 'Epochs to train.')
  tf.config.set_visible_devices([], 'GPU')
  app.run(lambda argv: train_and_report(flags.FLAGS.data_dir, flags.FLAGS.num_epochs))

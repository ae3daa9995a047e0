"""A ViT's train step on a CUDA GPU with cuDNN's fused attention (`kernels/gpu.py`) against the
stock `jax.nn.dot_product_attention` (XLA's), in one process, and their agreement.

    python -m benchmarks.attention_gpu [--models=vit_small_patch16_224,vit_base_patch16_224]
        [--batch_size=128] [--steps=20] [--rounds=3] [--json=attention_gpu.json]

Each model is built twice from the same seed, with the stock layers and with the GPU layers
(`kernels.select_layers('off'|'auto', 'gpu', 'bfloat16')`: bfloat16 compute, float32
parameters), and trained by one compiled step (softmax cross-entropy, SGD with momentum, the
parameters donated) on random 224-px batches. The two alternate, `--steps` steps a round, for
`--rounds` rounds; the figure is images/s of the median round, the compile excluded. Before
timing, the first step's loss and the logits of one batch are compared: bfloat16 sums in
another order, so they agree to bfloat16's precision, not bit for bit. Needs JAX's CUDA plugin;
no TensorFlow (the app's models and kernels alone).
"""

import statistics
import time

from absl import app
from absl import flags

from core import runtime  # pylint: disable=unused-import  (before JAX: its start-up settings)
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
import kernels
import models

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['vit_small_patch16_224', 'vit_base_patch16_224'], 'ViTs.')
flags.DEFINE_integer('batch_size', 128, 'Images a step.')
flags.DEFINE_integer('steps', 20, 'Timed steps a round.')
flags.DEFINE_integer('rounds', 3, 'Rounds, the two layer sets alternating.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
NUM_CLASSES = 1000
SIZE = 224


def build(name: str, kernels_setting: str):
  """The model (seed 0) with the stock ('stock') or GPU ('auto') layers in bfloat16, its
  optimizer, and the compiled train step."""
  layers = kernels.select_layers(kernels_setting, 'gpu', 'bfloat16')
  model = models.MODELS.entry(name).factory((SIZE, SIZE, 3), NUM_CLASSES, layers=layers,
                                            rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.01, momentum=0.9), wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, images, labels):
    def loss_of(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()
    loss, grads = nnx.value_and_grad(loss_of)(model)
    optimizer.update(model, grads)
    return loss

  return model, optimizer, step


def images_per_second(model, optimizer, step, batch) -> float:
  start = time.perf_counter()
  for _ in range(FLAGS.steps):
    loss = step(model, optimizer, *batch)
  loss.block_until_ready()
  return FLAGS.steps * FLAGS.batch_size / (time.perf_counter() - start)


def compare(name: str) -> dict:
  keys = jax.random.split(jax.random.key(1), 2)
  batch = (jax.random.uniform(keys[0], (FLAGS.batch_size, SIZE, SIZE, 3)),
           jax.random.randint(keys[1], (FLAGS.batch_size,), 0, NUM_CLASSES))
  built = {kind: build(name, setting) for kind, setting in (('stock', 'stock'),
                                                            ('cudnn', 'auto'))}
  logits = {kind: np.asarray(nnx.jit(lambda model, images: model(images))(model, batch[0]),
                             np.float32) for kind, (model, _, _) in built.items()}
  row = {'model': name, 'batch_size': FLAGS.batch_size,
         'max_logit_difference': float(np.abs(logits['stock'] - logits['cudnn']).max()),
         'max_logit': float(np.abs(logits['stock']).max())}
  for kind, (model, optimizer, step) in built.items():
    started = time.perf_counter()
    row[f'{kind}_first_loss'] = float(step(model, optimizer, *batch))
    row[f'{kind}_compile_and_first_step_s'] = round(time.perf_counter() - started, 2)
  rates = {kind: [] for kind in built}
  for _ in range(FLAGS.rounds):
    for kind, (model, optimizer, step) in built.items():
      rates[kind].append(images_per_second(model, optimizer, step, batch))
  for kind, values in rates.items():
    row[f'{kind}_images_per_sec'] = round(statistics.median(values), 1)
    row[f'{kind}_every_round'] = [round(value, 1) for value in values]
  row['speedup'] = round(row['cudnn_images_per_sec'] / row['stock_images_per_sec'], 3)
  print(row, flush=True)
  return row


def main(argv):
  del argv
  devices = jax.devices()
  if devices[0].platform != 'gpu':
    raise SystemExit(f'No CUDA GPU: JAX runs on {devices[0].platform}; install jax[cuda13].')
  print(f'{devices[0].device_kind}; jax {jax.__version__}', flush=True)
  rows = [compare(name) for name in FLAGS.models]
  print(harness.markdown_table(
      ['model', 'stock (XLA) images/s', 'cuDNN images/s', 'speed-up', 'max logit difference'],
      [[row['model'], row['stock_images_per_sec'], row['cudnn_images_per_sec'],
        f'{row["speedup"]:.2f}x', f'{row["max_logit_difference"]:.3g} of {row["max_logit"]:.3g}']
       for row in rows], align='lrrrr'))
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'device': devices[0].device_kind, 'jax': jax.__version__,
                                    'steps': FLAGS.steps, 'rounds': FLAGS.rounds, 'rows': rows})


if __name__ == '__main__':
  app.run(main)

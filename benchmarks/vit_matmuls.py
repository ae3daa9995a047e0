"""The matmuls of a ViT's train step, each alone, in XLA:CPU and in PyTorch: how much of the
step's gap to timm is the matrix library's.

    python -m benchmarks.vit_matmuls [--model=vit_small_patch16_224] [--batch_size=32]
        [--calls=10] [--rounds=3] [--json=vit_matmuls.json]

A block's train step multiplies the same few shapes: each linear layer's forward pass, its input
gradient and its weight gradient (`'mk,kn->mn'`, `'mn,kn->mk'`, `'mk,mn->kn'`), and attention's
two batched matmuls forward and four backward, in the contractions autodiff of
`kernels.cpu.dot_product_attention` emits. Each row times one of them on float32 arrays of the
model's size (224 px, --batch_size images): a jitted `jnp.einsum` and `torch.einsum` with the same
subscripts (one thread per core each), alternating, the median of --calls calls, the median of
--rounds rounds. A row's count is how many times a step runs it (the model's depth, twice for
attention's backward contractions that share a form); their total is what the step's matmuls
cost at each library's speed, beside timm's whole step (`benchmarks.backbones`).
"""

import math
import os

from absl import app
from absl import flags

from core import runtime  # pylint: disable=unused-import  (before JAX: its start-up settings)
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
import models

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'vit_small_patch16_224', 'A registered ViT.')
flags.DEFINE_integer('batch_size', 32, 'Images a step.')
flags.DEFINE_integer('calls', 10, 'Timed calls of each matmul a round.')
flags.DEFINE_integer('rounds', 3, 'Rounds, the two libraries alternating.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
SIZE = 224


def matmuls(model: str, batch_size: int) -> list[dict]:
  """Each matmul of one block's train step of `model`: its name, subscripts, operand shapes
  and how many times a step runs it."""
  vit = models.MODELS.entry(model).factory
  features, depth = vit.features, vit.depth
  heads, head_features = vit.num_heads, vit.features // vit.num_heads
  tokens = (SIZE // vit.patch_size) ** 2 + 1  # The patches and the class token.
  rows = batch_size * tokens
  linear_forms = (('forward', 'mk,kn->mn', lambda k, n: ((rows, k), (k, n))),
                  ('input gradient', 'mn,kn->mk', lambda k, n: ((rows, n), (k, n))),
                  ('weight gradient', 'mk,mn->kn', lambda k, n: ((rows, k), (rows, n))))
  found = []
  for layer, (k, n) in (('qkv', (features, 3 * features)), ('proj', (features, features)),
                        ('mlp.fc1', (features, 4 * features)),
                        ('mlp.fc2', (4 * features, features))):
    for form, subscripts, shapes in linear_forms:
      found.append({'name': f'{layer} {form}', 'subscripts': subscripts,
                    'shapes': shapes(k, n), 'count': depth})
  scores = (batch_size, heads, tokens, tokens)
  vectors = (batch_size, heads, tokens, head_features)
  for name, subscripts, shapes, count in (
      ('attention logits (forward; value-gradient form)', 'bnth,bnsh->bnts',
       (vectors, vectors), 2 * depth),
      ('attention output (forward; query-gradient form)', 'bnts,bnsh->bnth',
       (scores, vectors), 2 * depth),
      ('attention key and value gradients', 'bnts,bnth->bnsh', (scores, vectors), 2 * depth)):
    found.append({'name': name, 'subscripts': subscripts, 'shapes': shapes, 'count': count})
  return found


def flop(subscripts: str, shapes) -> int:
  """2 x the product of every index's size: the multiply-adds of the contraction."""
  sizes = {}
  for operand, shape in zip(subscripts.split('->')[0].split(','), shapes):
    sizes.update(zip(operand, shape))
  return 2 * math.prod(sizes.values())


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(len(os.sched_getaffinity(0)))  # As benchmarks.backbones.
  rng = np.random.default_rng(0)
  rows = []
  for matmul in matmuls(FLAGS.model, FLAGS.batch_size):
    operands = [rng.standard_normal(shape, dtype=np.float32) for shape in matmul['shapes']]
    on_jax = [jnp.asarray(each) for each in operands]
    on_torch = [torch.from_numpy(each) for each in operands]
    jitted = jax.jit(lambda *x, subscripts=matmul['subscripts']: jnp.einsum(subscripts, *x))
    timed = {
        'xla': lambda: jitted(*on_jax).block_until_ready(),
        'torch': lambda: torch.einsum(matmul['subscripts'], *on_torch),
    }
    for run in timed.values():
      run()  # Compiles (JAX), warms the caches and thread pools.
    medians = {library: [] for library in timed}
    for _ in range(FLAGS.rounds):
      for library, run in timed.items():
        medians[library].append(harness.median(harness.time_calls(run, FLAGS.calls)))
    seconds = {library: harness.median(values) for library, values in medians.items()}
    work = flop(matmul['subscripts'], matmul['shapes'])
    rows.append({**matmul, 'gflop': work / 1e9,
                 **{f'{library}_ms': 1e3 * value for library, value in seconds.items()},
                 **{f'{library}_gflops': work / value / 1e9 for library, value in seconds.items()}})
  totals = {library: sum(row['count'] * row[f'{library}_ms'] for row in rows) / 1e3
            for library in ('xla', 'torch')}
  print(harness.machine_line(harness.machine()))
  print(harness.markdown_table(
      ('matmul', 'subscripts', 'a step', 'XLA ms', 'PyTorch ms', 'XLA GFLOP/s',
       'PyTorch GFLOP/s', 'XLA / PyTorch time'),
      [(row['name'], f"`{row['subscripts']}`", row['count'], f"{row['xla_ms']:.2f}",
        f"{row['torch_ms']:.2f}", f"{row['xla_gflops']:.0f}", f"{row['torch_gflops']:.0f}",
        f"{row['xla_ms'] / row['torch_ms']:.2f}x") for row in rows]))
  print(f"A step's matmuls: {totals['xla']:.2f} s in XLA, {totals['torch']:.2f} s in PyTorch.")
  if FLAGS.json:
    harness.write_json(FLAGS.json, {
        'model': FLAGS.model, 'batch_size': FLAGS.batch_size, 'image_size': SIZE,
        'calls': FLAGS.calls, 'rounds': FLAGS.rounds,
        'step_matmul_seconds': totals, 'matmuls': rows})


if __name__ == '__main__':
  app.run(main)

"""benchmarks/vit_matmuls.py: its matmuls are those of a ViT's train step, and the whole
benchmark at a toy size."""

import json
import math
import os
import subprocess
import sys

from flax import nnx
import jax
import optax

from benchmarks import vit_matmuls
from tests.helpers.optional import requires_extras
import kernels
import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_CLASSES = 5


def _dot_flop(jaxpr) -> int:
  """2 x the multiply-adds of every dot_general in `jaxpr` and the jaxprs inside it: the output's
  size times the contracted dimensions' (counted apart from `vit_matmuls.flop`)."""
  total = 0
  for equation in jaxpr.eqns:
    if equation.primitive.name == 'dot_general':
      (contracting, _), _ = equation.params['dimension_numbers']
      lhs = equation.invars[0].aval.shape
      total += 2 * math.prod(equation.outvars[0].aval.shape) * math.prod(
          lhs[axis] for axis in contracting)
    for param in equation.params.values():
      for inner in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(inner, jax.extend.core.ClosedJaxpr):
          total += _dot_flop(inner.jaxpr)
        elif isinstance(inner, jax.extend.core.Jaxpr):
          total += _dot_flop(inner)
  return total


def test_the_matmuls_are_every_matmul_of_the_train_step_but_the_head():
  """Their FLOPs times their counts add up to those of every dot_general in the gradient of a
  ViT's loss, less the classifier's three (its forward pass, input and weight gradients). With
  the stock layers, the patch embedding is a convolution, not a matmul."""
  name, batch_size = 'vit_tiny_patch16_224', 2
  model = nnx.eval_shape(lambda: models.MODELS.entry(name).factory(
      (vit_matmuls.SIZE, vit_matmuls.SIZE, 3), NUM_CLASSES, layers=kernels.STOCK_LAYERS,
      rngs=nnx.Rngs(0)))
  images = jax.ShapeDtypeStruct((batch_size, vit_matmuls.SIZE, vit_matmuls.SIZE, 3), 'float32')
  labels = jax.ShapeDtypeStruct((batch_size,), 'int32')
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest, images, labels):
    logits = nnx.merge(graph, params, rest)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  step = jax.make_jaxpr(jax.grad(loss))(params, rest, images, labels)
  head = 3 * 2 * batch_size * model.features * NUM_CLASSES
  listed = sum(each['count'] * vit_matmuls.flop(each['subscripts'], each['shapes'])
               for each in vit_matmuls.matmuls(name, batch_size))
  assert listed + head == _dot_flop(step.jaxpr)


def test_the_benchmark_writes_a_row_per_matmul(tmp_path):
  requires_extras('torch')
  path = tmp_path / 'matmuls.json'
  subprocess.run([sys.executable, '-m', 'benchmarks.vit_matmuls', '--model=vit_tiny_patch16_224',
                  '--batch_size=1', '--calls=1', '--rounds=1', f'--json={path}'], cwd=ROOT,
                 check=True, capture_output=True, timeout=600)
  figures = json.loads(path.read_text())
  assert len(figures['matmuls']) == len(vit_matmuls.matmuls('vit_tiny_patch16_224', 1))
  for row in figures['matmuls']:
    assert row['xla_ms'] > 0 and row['torch_ms'] > 0
  assert figures['step_matmul_seconds']['xla'] > 0 and figures['machine']

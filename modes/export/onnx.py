"""`--export_format=onnx`: `<workdir>/export_onnx/model.onnx`, for ONNX Runtime, through
jax2onnx; model-size images."""

import logging as python_logging

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from modes import export


@export.FORMATS.register('onnx')
class Onnx(export.Format):
  """An ONNX model (`images` -> `logits`), its batch size symbolic."""
  directory = 'export_onnx'
  file = 'model.onnx'
  usage = "onnxruntime.InferenceSession(path).run(['logits'], {'images': images})[0]"

  def write(self, classifier: export.Classifier, path: str) -> None:
    """Through jax2onnx, from the function's jaxpr (lax primitives only): jax2onnx's own
    replacements of flax layers, patched in while it traces, fail on this JAX version."""
    jax2onnx = export.require('jax2onnx', 'onnx')
    # Its dm_pix plugins fail to import on this JAX version (unused here), each with a
    # traceback.
    python_logging.getLogger('jax2onnx').setLevel(python_logging.ERROR)
    batch, = jax.export.symbolic_shape('batch')
    spec = classifier.images_spec(batch)
    jaxpr = jax.make_jaxpr(classifier.closed)(spec)
    jax2onnx.to_onnx(lambda images: _with_onnx_max_pools(jaxpr, images)[0], [spec],
                     model_name='classifier', input_names=['images'], output_names=['logits'],
                     return_mode='file', output_path=path)

  def run(self, path: str, images: np.ndarray) -> np.ndarray:
    session = export.require('onnxruntime', 'onnx').InferenceSession(path)
    return session.run(['logits'], {'images': images})[0]


def _with_onnx_max_pools(jaxpr: jax_core.ClosedJaxpr, *args) -> list:
  """`jaxpr` evaluated on `args` (as `jax.core.eval_jaxpr`), its NHWC max pools written as
  ONNX Runtime runs them.

  jax2onnx 0.13 writes a max pool (`reduce_window_max`) as one ONNX MaxPool whose spatial axes
  are all the operand's: an NHWC pool (a ResNet's stem) becomes a 4-D MaxPool, and ONNX
  Runtime runs at most 3-D ones. With batch and channels folded into one leading axis
  (N*C, H, W), the same pool is a 3-D MaxPool with a window of 1 on that axis: the same maxima.
  """
  env = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts)) | dict(zip(jaxpr.jaxpr.invars, args))
  read = lambda var: var.val if isinstance(var, jax_core.Literal) else env[var]
  for eqn in jaxpr.jaxpr.eqns:
    inputs = [read(var) for var in eqn.invars]
    if eqn.primitive is jax.lax.reduce_window_max_p and _is_nhwc_pool(**eqn.params):
      outputs = [_folded_max_pool(*inputs, **eqn.params)]
    else:
      outputs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
      outputs = outputs if eqn.primitive.multiple_results else [outputs]
    env.update(zip(eqn.outvars, outputs))
  return [read(var) for var in jaxpr.jaxpr.outvars]


def _is_nhwc_pool(window_dimensions, window_strides, padding, base_dilation,
                  window_dilation) -> bool:
  """Whether a `reduce_window_max` pools the middle two of four axes only."""
  return (len(window_dimensions) == 4 and set(base_dilation) == {1}
          and all(values[0] == values[3] == 1 for values in
                  (window_dimensions, window_strides, window_dilation))
          and padding[0] == padding[3] == (0, 0))


def _folded_max_pool(images: jax.Array, *, window_dimensions, window_strides, padding,
                     base_dilation, window_dilation) -> jax.Array:
  """An NHWC max pool computed on (N*C, H, W)."""
  del base_dilation  # All 1 (`_is_nhwc_pool`).
  batch, height, width, channels = images.shape
  folded = jnp.transpose(images, (0, 3, 1, 2)).reshape(-1, height, width)
  pooled = jax.lax.reduce_window(folded, -jnp.inf, jax.lax.max, (1, *window_dimensions[1:3]),
                                 (1, *window_strides[1:3]), ((0, 0), *padding[1:3]),
                                 window_dilation=(1, *window_dilation[1:3]))
  return jnp.transpose(pooled.reshape(batch, channels, *pooled.shape[1:]), (0, 2, 3, 1))

"""The layers models are built from: flax's stock layers, or faster ones with the same function.

Models take a `Layers` and build their convolutions, dense layers, batch and layer norms,
dropout, average and max pooling, attention and exact GELU from it, the way flax's imagenet
example injects `conv: ModuleDef`.
`select_layers` is the one place that decides, by `config.kernels` and JAX's backend,
whether the stock layers, the XLA:CPU ones (`kernels/cpu.py`), the CUDA ones (`kernels/gpu.py`)
or the TPU ones (`kernels/tpu.py`) are used, and, by
`config.compute_dtype`, the dtype the layers compute in (their parameters stay float32). All
build the same parameters, so a checkpoint written with one restores into the other.
"""

from collections.abc import Callable
import dataclasses
import functools

from flax import nnx
import jax
import jax.numpy as jnp

from core import errors
from kernels import cpu
from kernels import gpu
from kernels import tpu

KERNELS = ('auto', 'stock')
COMPUTE_DTYPES = ('float32', 'bfloat16')


@dataclasses.dataclass(frozen=True)
class Layers:
  """Constructors and functions with the signatures of the stock flax layers they stand for."""
  conv: Callable[..., nnx.Conv] = nnx.Conv
  linear: Callable[..., nnx.Linear] = nnx.Linear
  batch_norm: Callable[..., nnx.BatchNorm] = nnx.BatchNorm
  layer_norm: Callable[..., nnx.LayerNorm] = nnx.LayerNorm
  dropout: Callable[..., nnx.Dropout] = nnx.Dropout
  avg_pool: Callable[..., jax.Array] = nnx.avg_pool
  max_pool: Callable[..., jax.Array] = nnx.max_pool
  attention: Callable[..., jax.Array] = jax.nn.dot_product_attention
  gelu: Callable[[jax.Array], jax.Array] = functools.partial(jax.nn.gelu, approximate=False)


STOCK_LAYERS = Layers()
CPU_LAYERS = Layers(conv=cpu.Conv, batch_norm=cpu.BatchNorm, layer_norm=cpu.LayerNorm,
                    dropout=cpu.Dropout, avg_pool=cpu.avg_pool, max_pool=cpu.max_pool,
                    attention=cpu.dot_product_attention, gelu=cpu.gelu)
GPU_LAYERS = Layers(attention=gpu.dot_product_attention)
TPU_LAYERS = Layers(conv=tpu.Conv, attention=tpu.dot_product_attention, gelu=tpu.gelu)


def select_layers(kernels: str, backend: str | None = None,
                  compute_dtype: str = 'float32') -> Layers:
  """The layers for `config.kernels` on `backend` (default: JAX's default backend).

  'auto' uses the CPU layers on the CPU backend, the GPU layers on the CUDA backend ('gpu'), the
  TPU layers on the TPU backend and the stock layers everywhere else; 'stock' always uses the
  stock layers. With `compute_dtype` 'bfloat16' the layers with parameters compute in bfloat16
  (their inputs and parameters are cast to it) and keep float32 parameters; the layers without
  parameters compute in the dtype of their inputs.
  """
  for key, value, valid in (('kernels', kernels, KERNELS),
                            ('compute_dtype', compute_dtype, COMPUTE_DTYPES)):
    if value not in valid:
      raise errors.ConfigError(f'Unknown {key} {value!r}: config.{key} must be one of '
                               f'{list(valid)}.', key=key, value=value)
  backend = backend or jax.default_backend()
  layers = ({'cpu': CPU_LAYERS, 'gpu': GPU_LAYERS, 'tpu': TPU_LAYERS}.get(backend, STOCK_LAYERS)
            if kernels == 'auto' else STOCK_LAYERS)
  if compute_dtype == 'float32':
    return layers

  def in_dtype(layer):
    return functools.partial(layer, dtype=jnp.dtype(compute_dtype), param_dtype=jnp.float32)

  return dataclasses.replace(layers, conv=in_dtype(layers.conv), linear=in_dtype(layers.linear),
                             batch_norm=in_dtype(layers.batch_norm))

"""The layers models are built from: flax's stock layers, or faster ones with the same function.

Models take a `Layers` and build their convolutions, dropout and pooling from it, the way flax's
imagenet example injects `conv: ModuleDef`. `select_layers` is the one place that decides, by
`config.cpu_kernels` and JAX's backend, whether the stock layers or the XLA:CPU ones
(`kernels/cpu.py`) are used. Both build the same parameters, so a checkpoint written with one
restores into the other.
"""

from collections.abc import Callable
import dataclasses

from flax import nnx
import jax

from kernels import cpu

CPU_KERNELS = ('auto', 'off')


@dataclasses.dataclass(frozen=True)
class Layers:
  """Constructors and functions with the signatures of the stock flax layers they stand for."""
  conv: Callable[..., nnx.Conv] = nnx.Conv
  dropout: Callable[..., nnx.Dropout] = nnx.Dropout
  avg_pool: Callable[..., jax.Array] = nnx.avg_pool


STOCK_LAYERS = Layers()
CPU_LAYERS = Layers(conv=cpu.Conv, dropout=cpu.Dropout, avg_pool=cpu.avg_pool)


def select_layers(cpu_kernels: str, backend: str | None = None) -> Layers:
  """The layers for `config.cpu_kernels` on `backend` (default: JAX's default backend).

  'auto' uses the CPU layers on the CPU backend and the stock layers everywhere else; 'off'
  always uses the stock layers.
  """
  if cpu_kernels not in CPU_KERNELS:
    raise ValueError(f'Unknown cpu_kernels {cpu_kernels!r}: one of {CPU_KERNELS}.')
  backend = backend or jax.default_backend()
  return CPU_LAYERS if cpu_kernels == 'auto' and backend == 'cpu' else STOCK_LAYERS

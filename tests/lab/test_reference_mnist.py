"""The app's CNN against the reference it is measured against (benchmarks/reference_mnist.py,
the Flax MNIST example's model): the same function."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import reference_mnist
import kernels
from tests.helpers.build import create_model
from training import state as state_lib


@pytest.mark.parametrize('kernels_setting', kernels.KERNELS)
def test_cnn_is_the_reference_example_function(kernels_setting):
  """The same parameters give the reference CNN's outputs in eval mode, and in training mode the
  same outputs and gradients when dropout is deterministic (the masks are random by design)."""
  model = create_model('cnn', kernels=kernels_setting)
  reference = state_lib.run_once(lambda: reference_mnist.ReferenceCNN(rngs=nnx.Rngs(1)))
  nnx.update(reference, *nnx.state(model, nnx.Param, nnx.BatchStat))
  x = jax.random.uniform(jax.random.key(0), (16, 28, 28, 1))
  for train in (False, True):
    for module in (model, reference):
      module.eval() if not train else module.set_attributes(deterministic=True)
    loss = lambda module: jnp.sin(module(x)).sum()
    outputs = [nnx.jit(lambda module: module(x))(module) for module in (model, reference)]
    np.testing.assert_allclose(*outputs, rtol=1e-4, atol=1e-4)
    grads, reference_grads = (nnx.jit(nnx.grad(loss))(module) for module in (model, reference))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
                 grads, reference_grads)

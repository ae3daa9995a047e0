"""The XLA:CPU layers equal flax's stock layers, in the cases they speed up and in every other
case (which they leave to the stock computation), and are chosen in one place."""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import errors
import kernels
from kernels import cpu
from kernels import gpu
from kernels import tpu
import models
from tests.helpers import small_backbones  # pylint: disable=unused-import  (registers them)
from tests.helpers.build import create_backbone
from training import state as state_lib


def _normal(seed: int, shape, dtype=np.float32) -> np.ndarray:
  """Standard normal test data drawn by NumPy: `jax.random.normal` would compile a program for
  each new shape, at XLA's full optimisation level, for data that a test uses once."""
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _built(layer, *args, **kwargs) -> nnx.Module:
  """`layer(*args, **kwargs, rngs=nnx.Rngs(0))` initialised in one program (`run_once`): op by
  op, each initialiser of a new shape would compile alone."""
  return state_lib.run_once(lambda: layer(*args, **kwargs, rngs=nnx.Rngs(0)))


def test_select_layers_by_backend_and_switch():
  assert kernels.select_layers('auto', 'cpu') is kernels.CPU_LAYERS
  assert kernels.select_layers('auto', 'gpu') is kernels.GPU_LAYERS
  assert kernels.select_layers('auto', 'tpu') is kernels.TPU_LAYERS
  for backend in ('cpu', 'gpu', 'tpu'):
    assert kernels.select_layers('stock', backend) is kernels.STOCK_LAYERS
  with pytest.raises(errors.ConfigError) as error:
    kernels.select_layers('on', 'cpu')
  assert (error.value.key, error.value.value) == ('kernels', 'on')


def test_gpu_attention_is_the_stock_function_where_cudnn_does_not_take_the_inputs():
  """float32 inputs (cuDNN's fused attention takes half precision) and a mask run as the stock
  function runs them."""
  query, key, value = _normal(0, (3, 2, 5, 2, 8))
  mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]
  for options in ({}, {'mask': mask}):
    np.testing.assert_array_equal(
        gpu.dot_product_attention(query, key, value, **options),
        jax.nn.dot_product_attention(query, key, value, **options))


@pytest.mark.parametrize('kernel_size', [(3, 3), (2, 2), (5, 3), (1, 1)])
@pytest.mark.parametrize('strides,padding', [
    (1, 'SAME'), (2, 'SAME'), ((2, 1), 'VALID'), (2, ((1, 1), (1, 1))), (3, ((3, 0), (0, 2))),
])
def test_conv_and_its_gradients_equal_nnx_conv(kernel_size, strides, padding):
  channels = kernel_size[0]  # 1 to 5 channels in; a bias on half of them.
  arguments = dict(kernel_size=kernel_size, strides=strides, padding=padding,
                   use_bias=channels % 2 == 1)
  stock, fast = (_built(layer, channels, 5, **arguments) for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (3, 9, 8, channels))
  np.testing.assert_array_equal(fast.kernel[...], stock.kernel[...])  # Same parameters.
  # Under differentiation the patches' matmul computes it (not the stock convolution).
  assert 'convolution' not in jax.jit(jax.grad(lambda x: fast(x).sum())).lower(x).as_text()
  (y, *grads), (stock_y, *stock_grads) = _value_and_grads(fast, x), _value_and_grads(stock, x)
  np.testing.assert_allclose(y, stock_y, rtol=1e-5, atol=1e-5)
  for grad, stock_grad in zip(grads, stock_grads):
    np.testing.assert_allclose(grad, stock_grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('height,width,convolution', [(2, 2, False), (1, 6, False),
                                                       (6, 2, False), (3, 3, True)])
def test_conv_without_gradients_is_a_matmul_where_its_output_is_two_pixels_or_less(
    height, width, convolution):
  """In eval and predict a convolution runs as XLA's, but where its output is at most 2 pixels
  high or wide (XLA:CPU's slow case), as the patches' matmul: the stock layer's values."""
  stock, fast = (_built(layer, 8, 6, kernel_size=(3, 3)) for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (4, height, width, 8))
  assert ('convolution' in jax.jit(lambda x: fast(x)).lower(x).as_text()) == convolution
  np.testing.assert_allclose(fast(x), stock(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('in_features,kernel_size,strides,padding', [
    (1, (3, 3), 1, 'SAME'), (32, (3, 3), 1, 'SAME'), (3, (5, 3), 2, ((1, 2), (0, 1))),
    (56, (3, 3), (2, 1), 'VALID'),
])
def test_tpu_conv_runs_small_convolutions_as_a_matmul_equal_to_nnx_conv(
    in_features, kernel_size, strides, padding):
  """MNIST-sized convolutions: no convolution in the program, forward or backward, and the
  stock layer's values and gradients."""
  arguments = dict(kernel_size=kernel_size, strides=strides, padding=padding)
  stock, fast = (_built(layer, in_features, 8, **arguments) for layer in (nnx.Conv, tpu.Conv))
  x = _normal(0, (4, 12, 10, in_features))
  assert 'convolution' not in jax.jit(jax.grad(lambda x: fast(x).sum())).lower(x).as_text()
  (y, *grads), (stock_y, *stock_grads) = _value_and_grads(fast, x), _value_and_grads(stock, x)
  np.testing.assert_allclose(y, stock_y, rtol=1e-5, atol=1e-5)
  for grad, stock_grad in zip(grads, stock_grads):
    np.testing.assert_allclose(grad, stock_grad, rtol=1e-5, atol=1e-4)


def test_the_reference_cnn_on_the_tpu_layers_has_no_convolution_in_training_or_eval():
  """MNIST's CNN at its training batch (128) and eval batch (512): every convolution a
  matmul, as XLA:TPU compiles much faster."""
  cnn = _built(models.CNN, (28, 28, 1), 10, layers=kernels.TPU_LAYERS)
  loss = lambda cnn, x: cnn(x).sum()
  train = nnx.jit(nnx.grad(loss)).lower(cnn, _normal(0, (128, 28, 28, 1))).as_text()
  cnn.eval()
  evaluate = nnx.jit(lambda cnn, x: cnn(x)).lower(cnn, _normal(0, (512, 28, 28, 1))).as_text()
  assert 'dot_general' in train and 'convolution' not in train + evaluate


@pytest.mark.parametrize('in_features,kernel_size,strides,image,limit', [
    (57, (3, 3), 1, 12, tpu.PATCHES_LIMIT_BYTES),  # 513 products an output: a wide layer's.
    (3, (16, 16), 16, 48, tpu.PATCHES_LIMIT_BYTES),  # A ViT's patch embedding (768).
    (1, (3, 3), 1, 33, tpu.PATCHES_LIMIT_BYTES),  # 33 x 33 pixels out: a larger image's.
    (1, (3, 3), 1, 12, 4 * 12 * 12 * 9 * 4 - 1),  # A patch matrix over the limit.
])
def test_tpu_conv_leaves_larger_convolutions_to_xla(in_features, kernel_size, strides, image,
                                                    limit, monkeypatch):
  monkeypatch.setattr(tpu, 'PATCHES_LIMIT_BYTES', limit)
  arguments = dict(kernel_size=kernel_size, strides=strides)
  stock, fast = (_built(layer, in_features, 4, **arguments) for layer in (nnx.Conv, tpu.Conv))
  x = _normal(0, (4, image, image, in_features))
  assert 'convolution' in jax.jit(jax.grad(lambda x: fast(x).sum())).lower(x).as_text()
  np.testing.assert_array_equal(fast(x), stock(x))


@pytest.mark.parametrize('option', [
    {'kernel_dilation': 2},
    {'input_dilation': (2, 2), 'padding': ((1, 1), (1, 1))}, {'feature_group_count': 2},
    {'precision': 'highest'},
    {'preferred_element_type': jnp.float32}, {'kernel_size': (3,)},
    {'kernel_size': (3, 3, 3)}, {'conv_general_dilated': jax.lax.conv_general_dilated},
])
def test_conv_computes_every_other_convolution_as_the_stock_layer(option):
  arguments = {'kernel_size': (3, 3), **option}
  stock, fast = (_built(layer, 4, 4, **arguments) for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (2, *[8] * len(arguments['kernel_size']), 4))
  (y, *grads), (stock_y, *stock_grads) = _value_and_grads(fast, x), _value_and_grads(stock, x)
  np.testing.assert_allclose(y, stock_y, rtol=1e-5, atol=1e-5)
  for grad, stock_grad in zip(grads, stock_grads):
    np.testing.assert_allclose(grad, stock_grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('kernel_size,strides,padding', [
    # EfficientNet's (stride 2 with flax's 'SAME' padding too), ConvNeXt's.
    ((3, 3), 1, 'SAME'), ((3, 3), 2, ((1, 1), (1, 1))), ((5, 5), 2, 'SAME'),
    ((7, 7), 1, ((3, 3), (3, 3))),
    ((5, 3), (3, 2), ((4, 0), (0, 3))), ((2, 2), (2, 1), 'VALID'),
])
def test_depthwise_conv_and_its_gradients_equal_nnx_conv(kernel_size, strides, padding):
  channels = 2 * kernel_size[0] - 1  # 3 to 13 channels, one filter each; odd image sizes.
  arguments = dict(kernel_size=kernel_size, strides=strides, padding=padding,
                   feature_group_count=channels, use_bias=kernel_size[0] == 3)
  stock, fast = (_built(layer, channels, channels, **arguments)
                 for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (3, 11, 9, channels))
  # Shifted multiply-adds compute it, forward and backward (not XLA's convolution).
  assert 'convolution' not in jax.jit(jax.grad(lambda x: fast(x).sum())).lower(x).as_text()
  for value, stock_value in zip(_value_and_grads(fast, x), _value_and_grads(stock, x)):
    np.testing.assert_allclose(value, stock_value, rtol=1e-5, atol=1e-5)


def _value_and_grads(conv: nnx.Conv, x: jax.Array) -> list[jax.Array]:
  """`conv(x)` and the gradients of a random projection of it (the bias, kernel and input), in
  one program (`run_once`): op by op, each of a 7x7 kernel's 49 taps would compile alone."""
  def value_and_grads(conv, x):
    loss = lambda conv, x: (conv(x) * jax.random.normal(jax.random.key(2), conv(x).shape)).sum()
    return [conv(x), *jax.tree.leaves(nnx.grad(loss, argnums=(0, 1))(conv, x))]
  return state_lib.run_once(value_and_grads, conv, x)


def test_depthwise_conv_in_bfloat16_accumulates_as_the_stock_layer():
  arguments = dict(kernel_size=(5, 5), strides=2, feature_group_count=8, dtype=jnp.bfloat16)
  stock, fast = (_built(layer, 8, 8, **arguments) for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (2, 16, 16, 8))
  assert fast(x).dtype == jnp.bfloat16
  # Within bfloat16's rounding: both sum the 25 taps in float32, and round once.
  for value, stock_value in zip(_value_and_grads(fast, x), _value_and_grads(stock, x)):
    np.testing.assert_allclose(value.astype(jnp.float32), stock_value.astype(jnp.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize('features,option', [
    (8, {}),  # Two filters a channel (a depth multiplier of 2).
    (4, {'kernel_dilation': 2}), (4, {'input_dilation': 2, 'padding': ((1, 1), (1, 1))}),
])
def test_other_depthwise_convolutions_run_as_the_stock_layer(features, option):
  arguments = {'kernel_size': (3, 3), 'feature_group_count': 4, **option}
  stock, fast = (_built(layer, 4, features, **arguments) for layer in (nnx.Conv, cpu.Conv))
  x = _normal(0, (2, 9, 8, 4))
  assert 'convolution' in jax.jit(lambda x: fast(x)).lower(x).as_text()
  for value, stock_value in zip(_value_and_grads(fast, x), _value_and_grads(stock, x)):
    np.testing.assert_allclose(value, stock_value, rtol=1e-5, atol=1e-5)


# Compiling the model's forward and backward passes with each layer set: ~30 s.
@pytest.mark.slow
def test_a_depthwise_backbone_equals_itself_with_the_stock_layers():
  """EfficientNet's 3x3 and 5x5 (strided ones too) depthwise convolutions between BatchNorms:
  the same logits and training gradients with the XLA:CPU layers, in the family's smallest
  member (tests/helpers/small_backbones.py; EfficientNet-B0 compiles for a minute or more;
  ConvNeXt's 7x7 is in the layer tests above). At 64 px (at 32 px the last stage is 1x1 and its
  BatchNorms amplify rounding: tests/test_backbones.py)."""
  images = np.random.default_rng(0).normal(size=(2, 64, 64, 3)).astype(np.float32)

  @nnx.jit
  def logits_and_grads(model):
    grads = nnx.grad(lambda model: (model(images) ** 2).mean())(model)
    model.eval()
    return model(images), grads

  fast, stock = (
      logits_and_grads(create_backbone('small_efficientnet_for_test', (64, 64, 3), layers=layers))
      for layers in (kernels.CPU_LAYERS, kernels.STOCK_LAYERS))
  for value, stock_value in zip(jax.tree.leaves(fast), jax.tree.leaves(stock)):
    # Within 1e-4 of each array's largest magnitude (summation orders differ), and 1e-6 for
    # gradients that are zero but for rounding (EfficientNet's BatchNorm before a 1x1
    # convolution and another BatchNorm, which cancels its bias).
    scale = float(np.abs(stock_value).max())
    np.testing.assert_allclose(value, stock_value, rtol=0, atol=1e-4 * scale + 1e-6)


@pytest.mark.parametrize('rate', [0.025, 0.5])
def test_dropout_drops_its_rate_and_keeps_the_mean(rate):
  dropout = cpu.Dropout(rate=rate, rngs=nnx.Rngs(0))
  ones = jnp.ones((1001, 999))
  first, second = dropout(ones), dropout(ones)
  dropped = first == 0
  # 4.5 standard deviations of a binomial count of 1M draws.
  assert float(dropped.mean()) == pytest.approx(rate, abs=4.5 * np.sqrt(rate * (1 - rate) / 1e6))
  np.testing.assert_allclose(np.unique(first), [0.0, 1 / (1 - rate)], rtol=1e-6)
  # Masks of successive calls, and of neighbouring rows and columns, look independent.
  both = float((dropped & (second == 0)).mean())
  assert both == pytest.approx(rate**2, abs=4.5 * np.sqrt(rate**2 / 1e6))
  for a, b in [(dropped[1:], dropped[:-1]), (dropped[:, 1:], dropped[:, :-1])]:
    assert float((a & b).mean()) == pytest.approx(rate**2, abs=4.5 * np.sqrt(rate**2 / 1e6))
  dropout.eval()
  assert jnp.array_equal(dropout(ones), ones)


def test_dropout_call_arguments_and_rates_as_the_stock_layer():
  x = jnp.ones((64, 64))
  first = cpu.Dropout(rate=0.5, rngs=nnx.Rngs(3))(x)
  np.testing.assert_array_equal(cpu.Dropout(rate=0.5, rngs=nnx.Rngs(3))(x), first)
  assert not jnp.array_equal(cpu.Dropout(rate=0.5, rngs=nnx.Rngs(4))(x), first)
  dropout = cpu.Dropout(rate=0.5)  # No rngs at construction: given at the call.
  np.testing.assert_array_equal(dropout(x, deterministic=True), x)
  by_key = dropout(x, rngs=jax.random.key(0))
  assert 0 < float((by_key == 0).mean()) < 1
  np.testing.assert_array_equal(dropout(x, rngs=jax.random.key(0)), by_key)
  for rate in (0.0, 1.0):
    np.testing.assert_array_equal(cpu.Dropout(rate, rngs=nnx.Rngs(0))(x),
                                  nnx.Dropout(rate, rngs=nnx.Rngs(0))(x))
  # A mask shared along axis 0: drawn as the stock layer draws it.
  np.testing.assert_array_equal(cpu.Dropout(0.5, broadcast_dims=(0,), rngs=nnx.Rngs(5))(x),
                                nnx.Dropout(0.5, broadcast_dims=(0,), rngs=nnx.Rngs(5))(x))


@pytest.mark.parametrize('shape,window', [((4, 28, 28, 32), (2, 2)), ((2, 7, 9, 3), (2, 2)),
                                          ((2, 9, 9, 3), (3, 3))])
def test_avg_pool_and_its_gradient_equal_nnx_avg_pool(shape, window):
  y = _normal(1, shape)  # Odd sizes: 'VALID' drops the rest.
  fast = lambda y: cpu.avg_pool(y, window_shape=window, strides=window)
  stock = lambda y: nnx.avg_pool(y, window_shape=window, strides=window)
  np.testing.assert_allclose(fast(y), stock(y), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda y: (fast(y) ** 2).sum())(y),
                             jax.grad(lambda y: (stock(y) ** 2).sum())(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('arguments', [
    {'window_shape': (2, 2)}, {'window_shape': (2, 2), 'strides': (1, 1)},
    {'window_shape': (2, 2), 'strides': (2, 2), 'padding': 'SAME'},
])
def test_avg_pool_computes_every_other_pooling_as_the_stock_function(arguments):
  y = _normal(1, (2, 7, 9, 3))
  np.testing.assert_allclose(cpu.avg_pool(y, **arguments), nnx.avg_pool(y, **arguments),
                             rtol=1e-6, atol=1e-6)


def test_conv_gradient_does_not_keep_every_layers_patches_from_the_forward_pass():
  # Six 3x3 layers: if XLA shared the backward passes' patches with the forward pass's (as it
  # did through an optimization barrier), all six would be held at once, beside the other
  # temporaries; rebuilt in each backward pass, they are held one or two at a time.
  x = _normal(0, (8, 32, 32, 16))
  kernel_list = [0.1 * _normal(i, (3, 3, 16, 16)) for i in range(6)]
  pads = ((1, 1), (1, 1))

  def loss(kernel_list, x):
    for kernel in kernel_list:
      x = jax.nn.relu(cpu.conv_patches(x, kernel, (1, 1), pads))
    return x.sum()

  compiled = jax.jit(jax.grad(loss)).lower(kernel_list, x).compile()
  patch_matrix = cpu.patches_bytes(x.shape, (3, 3, 16, 16), x.dtype, (1, 1), pads)
  assert compiled.memory_analysis().temp_size_in_bytes < 6 * patch_matrix


@pytest.mark.parametrize('shape,arguments', [
    ((2, 16, 15, 8), {'window_shape': (3, 3), 'strides': (2, 2), 'padding': ((1, 1), (1, 1))}),
    ((2, 9, 11, 3), {'window_shape': (3, 3), 'strides': (2, 2), 'padding': 'SAME'}),
    ((2, 9, 11, 3), {'window_shape': (2, 2), 'strides': (1, 1)}),
    ((2, 9, 11, 3), {'window_shape': (2, 3), 'strides': (2, 2)}),
])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_max_pool_and_its_gradient_equal_nnx_max_pool(shape, arguments, dtype):
  # Rounded normals after a ReLU: most windows hold tied maxima (zeros after a ResNet's ReLU),
  # where the gradient must go to the input select-and-scatter picks.
  x = jnp.maximum(jnp.round(2 * _normal(4, shape)), 0).astype(dtype)
  # Jitted: one compilation each rather than one per operation.
  fast = jax.jit(lambda x: cpu.max_pool(x, **arguments))
  stock = jax.jit(lambda x: nnx.max_pool(x, **arguments))
  np.testing.assert_array_equal(fast(x), stock(x))
  # Integer cotangents: the sums over overlapping windows are exact in any order.
  cotangent = np.random.default_rng(5).integers(-3, 4, stock(x).shape).astype(dtype)
  loss = lambda f: lambda x: jnp.vdot(f(x).astype(jnp.float32), cotangent.astype(jnp.float32))
  np.testing.assert_array_equal(jax.jit(jax.grad(loss(fast)))(x),
                                jax.jit(jax.grad(loss(stock)))(x))


def test_max_pool_gradient_needs_a_fraction_of_select_and_scatter_temporaries():
  x = _normal(4, (8, 56, 56, 16))
  arguments = {'window_shape': (3, 3), 'strides': (2, 2), 'padding': ((1, 1), (1, 1))}

  def temporaries(pool) -> int:
    backward = jax.jit(lambda x, dy: jax.vjp(lambda x: pool(x, **arguments), x)[1](dy))
    compiled = backward.lower(x, jnp.ones((8, 28, 28, 16))).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temporaries(cpu.max_pool) < temporaries(nnx.max_pool) / 2


@pytest.mark.parametrize('x,arguments', [
    (jnp.arange(2 * 9 * 3.0).reshape(2, 9, 3), {'window_shape': (2,), 'strides': (2,)}),
    (jnp.arange(2 * 7 * 9 * 3).reshape(2, 7, 9, 3), {'window_shape': (2, 2), 'strides': (2, 2)}),
])
def test_max_pool_computes_every_other_pooling_as_the_stock_function(x, arguments):
  np.testing.assert_array_equal(cpu.max_pool(x, **arguments), nnx.max_pool(x, **arguments))


def _attention_inputs(dtype=jnp.float32):
  """Query, key and value (batch, tokens, heads, head features), and an output cotangent."""
  return list(_normal(2, (4, 2, 17, 3, 8), dtype))


def test_attention_and_its_gradients_equal_the_stock_function():
  *qkv, cotangent = _attention_inputs()
  loss = lambda f: lambda *qkv: jnp.vdot(f(*qkv), cotangent)
  np.testing.assert_allclose(cpu.dot_product_attention(*qkv), jax.nn.dot_product_attention(*qkv),
                             rtol=1e-5, atol=1e-6)
  for fast, stock in zip(jax.grad(loss(cpu.dot_product_attention), argnums=(0, 1, 2))(*qkv),
                         jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(*qkv)):
    np.testing.assert_allclose(fast, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('dtype,options', [
    (jnp.float32, {'is_causal': True}), (jnp.float32, {'scale': 0.5}), (jnp.bfloat16, {})])
def test_attention_computes_every_other_case_as_the_stock_function(dtype, options):
  *qkv, _ = _attention_inputs(dtype)
  np.testing.assert_array_equal(cpu.dot_product_attention(*qkv, **options),
                                jax.nn.dot_product_attention(*qkv, **options))
  mask = jnp.tril(jnp.ones((17, 17), bool))
  np.testing.assert_array_equal(cpu.dot_product_attention(*qkv, mask=mask),
                                jax.nn.dot_product_attention(*qkv, mask=mask))


def test_tpu_attention_stores_its_scores_in_bfloat16_and_computes_the_stock_function():
  *qkv, cotangent = _attention_inputs(jnp.bfloat16)
  query, key, value = qkv
  scores = jnp.einsum('btnh,bsnh->bnts', query * jnp.asarray(8 ** -0.5, jnp.bfloat16), key)
  assert scores.dtype == jnp.bfloat16  # What it stores; the softmax reads them in float32:
  probabilities = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
  np.testing.assert_array_equal(tpu.dot_product_attention(*qkv),
                                jnp.einsum('bnts,bsnh->btnh', probabilities, value))
  # Within bfloat16's rounding of the stock function, forward and backward.
  wide = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(wide(tpu.dot_product_attention(*qkv)),
                             wide(jax.nn.dot_product_attention(*qkv)), atol=0.05)
  loss = lambda f: lambda *qkv: jnp.vdot(f(*qkv).astype(jnp.float32), cotangent)
  for fast, stock in zip(jax.grad(loss(tpu.dot_product_attention), argnums=(0, 1, 2))(*qkv),
                         jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2))(*qkv)):
    np.testing.assert_allclose(wide(fast), wide(stock), rtol=0.05, atol=0.1)
  # Float32 inputs, a mask or an option: the stock function.
  *qkv32, _ = _attention_inputs()
  np.testing.assert_array_equal(tpu.dot_product_attention(*qkv32),
                                jax.nn.dot_product_attention(*qkv32))
  mask = jnp.tril(jnp.ones((17, 17), bool))
  np.testing.assert_array_equal(tpu.dot_product_attention(*qkv, mask=mask),
                                jax.nn.dot_product_attention(*qkv, mask=mask))
  np.testing.assert_array_equal(tpu.dot_product_attention(*qkv, is_causal=True),
                                jax.nn.dot_product_attention(*qkv, is_causal=True))


def test_tpu_gelu_on_bfloat16_is_nearer_the_true_gelu_than_erf_in_bfloat16():
  # Every bfloat16 in [-10, 10]; the true GELU in float64 (NumPy's erf through math.erf).
  top = int(np.float32(10).view(np.uint32) >> 16)  # The high 16 bits of 10.0: a bfloat16.
  bits = np.concatenate([np.arange(top + 1), np.arange(top + 1) | 0x8000]).astype(np.uint32)
  x = jnp.asarray((bits << 16).view(np.float32)).astype(jnp.bfloat16)
  wide = np.asarray(x, np.float64)
  true = wide * 0.5 * (1 + np.vectorize(math.erf)(wide / math.sqrt(2)))
  rounded = np.asarray(jnp.asarray(true, jnp.float32).astype(jnp.bfloat16), np.float64)
  fast = np.asarray(tpu.gelu(x), np.float64)
  erf_in_bfloat16 = np.asarray(jax.nn.gelu(x, approximate=False), np.float64)
  assert tpu.gelu(x).dtype == jnp.bfloat16
  assert np.abs(fast - true).mean() < np.abs(erf_in_bfloat16 - true).mean()
  assert np.abs(fast - true).max() <= np.abs(erf_in_bfloat16 - true).max()
  assert (fast == rounded).mean() > 0.85
  # Float32 inputs: the exact GELU.
  x32 = 3 * _normal(4, (64,))
  np.testing.assert_array_equal(tpu.gelu(x32), jax.nn.gelu(x32, approximate=False))


def _input_sized_residuals(function, x: jax.Array) -> list[jax.Array]:
  """The arrays of `x`'s size or larger that the backward pass of `function` at `x` keeps (the
  residuals held by `jax.vjp`'s function; the input itself among them)."""
  _, backward = jax.vjp(function, x)
  return [residual for residual in jax.tree.leaves(backward) if residual.size >= x.size]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_gelu_and_its_gradient_equal_the_stock_function(dtype):
  x = (3 * _normal(3, (4, 33, 8))).astype(dtype)
  stock = lambda x: jax.nn.gelu(x, approximate=False)
  np.testing.assert_array_equal(cpu.gelu(x), stock(x))
  np.testing.assert_array_equal(kernels.STOCK_LAYERS.gelu(x), stock(x))
  loss = lambda f: lambda x: jnp.vdot(f(x).astype(jnp.float32), jnp.cos(x).astype(jnp.float32))
  tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(jax.grad(loss(cpu.gelu))(x).astype(np.float32),
                             jax.grad(loss(stock))(x).astype(np.float32),
                             rtol=tolerance, atol=tolerance)
  # The backward pass keeps the input alone (autodiff of the stock function keeps 3 more).
  assert len(_input_sized_residuals(cpu.gelu, x)) == 1
  assert len(_input_sized_residuals(stock, x)) > 1


def _layer_norms(features: int, **options) -> tuple[nnx.LayerNorm, nnx.LayerNorm]:
  """`cpu.LayerNorm` and `nnx.LayerNorm` with the same random scale and bias."""
  fast, stock = (_built(layer, features, **options) for layer in (cpu.LayerNorm, nnx.LayerNorm))
  for norm in (fast, stock):
    if norm.scale is not None:
      norm.scale[...] = 1 + _normal(40, norm.scale.shape, norm.scale.dtype)
    if norm.bias is not None:
      norm.bias[...] = _normal(41, norm.bias.shape, norm.bias.dtype)
  return fast, stock


def _norm_value_and_grads(norm: nnx.Module, x: jax.Array, cotangent: jax.Array):
  def loss(norm, x):
    return jnp.vdot(norm(x).astype(jnp.float32), cotangent)
  value = norm(x)
  grads = nnx.grad(loss, argnums=(0, 1))(norm, x)
  return [value, *jax.tree.leaves(grads)]


@pytest.mark.parametrize('shape,options', [
    ((2, 9, 16), {}), ((2, 4, 4, 8), {'epsilon': 1e-5}), ((3, 16), {'use_fast_variance': False}),
    ((2, 9, 16), {'dtype': jnp.bfloat16}), ((2, 9, 16), {'param_dtype': jnp.bfloat16})])
def test_layer_norm_and_its_gradients_equal_nnx_layer_norm(shape, options):
  """Over the last axis of a token sequence, of NHWC images (ConvNeXt's), in float32 and with
  half-precision inputs or parameters: the stock layer's output, the same gradients."""
  x = 3 + 2 * _normal(5, shape)
  if options.get('param_dtype') == jnp.bfloat16:
    x = x.astype(jnp.bfloat16)
  cotangent = _normal(6, shape)
  fast, stock = _layer_norms(shape[-1], **options)
  fast_values, stock_values = (_norm_value_and_grads(norm, x, cotangent)
                               for norm in (fast, stock))
  assert fast_values[0].dtype == stock_values[0].dtype
  np.testing.assert_array_equal(fast_values[0], stock_values[0])
  half = jnp.bfloat16 in (fast_values[0].dtype, x.dtype)
  for value, stock_value in zip(fast_values[1:], stock_values[1:]):
    assert value.dtype == stock_value.dtype
    scale = float(np.abs(np.asarray(stock_value, np.float32)).max())
    np.testing.assert_allclose(np.asarray(value, np.float32), np.asarray(stock_value, np.float32),
                               rtol=0, atol=(1e-2 if half else 1e-5) * scale)
  # The backward pass keeps the input (and per-row statistics), not four arrays of its size.
  assert len(_input_sized_residuals(fast, x)) == 1
  assert len(_input_sized_residuals(stock, x)) > 1


@pytest.mark.parametrize('options,call', [
    ({'reduction_axes': (-2, -1)}, {}), ({'feature_axes': -2}, {}), ({'use_bias': False}, {}),
    ({'use_scale': False}, {}), ({}, {'mask': jnp.arange(16) < 12})])
def test_layer_norm_computes_every_other_case_as_the_stock_layer(options, call):
  x = _normal(7, (2, 16, 16))
  fast, stock = _layer_norms(16, **options)
  np.testing.assert_array_equal(fast(x, **call), stock(x, **call))


@pytest.mark.parametrize('options', [{}, {'use_fast_variance': False}, {'dtype': jnp.bfloat16}])
def test_batch_norm_in_training_and_its_gradients_equal_nnx_batch_norm(options):
  """NHWC images: the stock layer's output and running averages, the same gradients; eval
  (the running averages) as the stock layer."""
  x = 3 + 2 * _normal(9, (4, 5, 5, 8))
  cotangent = _normal(10, x.shape)
  fast, stock = (layer(8, momentum=0.9, rngs=nnx.Rngs(0), use_running_average=False, **options)
                 for layer in (cpu.BatchNorm, nnx.BatchNorm))
  for norm in (fast, stock):
    norm.scale[...] = 1 + _normal(11, (8,))
    norm.bias[...] = _normal(12, (8,))
  fast_values, stock_values = (_norm_value_and_grads(norm, x, cotangent)
                               for norm in (fast, stock))
  np.testing.assert_array_equal(fast_values[0], stock_values[0])
  half = 'dtype' in options
  for value, stock_value in zip(fast_values[1:], stock_values[1:]):
    scale = float(np.abs(np.asarray(stock_value, np.float32)).max())
    np.testing.assert_allclose(np.asarray(value, np.float32), np.asarray(stock_value, np.float32),
                               rtol=0, atol=(1e-2 if half else 1e-5) * scale)
  for running, stock_running in ((fast.mean, stock.mean), (fast.var, stock.var)):
    np.testing.assert_array_equal(running[...], stock_running[...])
  # A copy of each layer, made in the traced function: it updates its running averages.
  def in_trace(norm):
    graphdef, state = nnx.split(norm)
    return lambda x: nnx.merge(graphdef, jax.tree.map(jnp.array, state))(x)
  assert len(_input_sized_residuals(in_trace(fast), x)) == 1
  assert len(_input_sized_residuals(in_trace(stock), x)) > 1
  np.testing.assert_array_equal(fast(x, use_running_average=True),
                                stock(x, use_running_average=True))


def test_softmax_and_its_gradient_equal_the_stock_function():
  x, cotangent = 4 * jax.random.normal(jax.random.key(8), (2, 2, 3, 17, 17))
  np.testing.assert_array_equal(cpu.softmax(x), jax.nn.softmax(x))
  loss = lambda f: lambda x: jnp.vdot(f(x), cotangent)
  np.testing.assert_allclose(jax.grad(loss(cpu.softmax))(x), jax.grad(loss(jax.nn.softmax))(x),
                             rtol=1e-5, atol=1e-6)
  assert len(_input_sized_residuals(cpu.softmax, x)) == 1

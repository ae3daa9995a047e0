"""Models: shapes, parameter counts, the reference CNN's order, options and the registry."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import errors
import kernels
import train
from configs import cifar10
from configs import default
import image_folders
from training import run_spec
from training import workdirs
from tests.helpers import build


_config, _built, _create = build.model_config, build.build_model, build.create_model


def _shapes(name, image_shape, **config_overrides):
  """The model `name` of `_create`, its structure only (shapes and dtypes, nothing computed)."""
  spec = run_spec.resolve(_config(name, **config_overrides)).model
  return nnx.eval_shape(lambda: spec.build(image_shape, 10, nnx.Rngs(0)))


def _count(model, kind):
  return sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, kind)))


@pytest.mark.parametrize('name', ['cnn', 'mlp'])
@pytest.mark.parametrize('image_shape,num_classes', [((28, 28, 1), 10), ((32, 32, 3), 7)])
def test_output_shape(name, image_shape, num_classes):
  model = _create(name, image_shape, num_classes)
  logits = model(jnp.zeros((5, *image_shape)))
  assert logits.shape == (5, num_classes)
  assert logits.dtype == jnp.float32


def test_cnn_parameter_count():
  model = _create('cnn')
  # conv1 320 + bn1 64 + conv2 18,496 + bn2 128 + dense 802,816+256 + dense 2,560+10.
  assert _count(model, nnx.Param) == 824_650
  # Running mean and variance of both BatchNorms (not trained by the optimizer).
  assert _count(model, nnx.BatchStat) == 192


def test_resnet20_parameter_count_and_shapes():
  # Shapes only (no init cost).
  model = _shapes('cifar_resnet', (32, 32, 3))
  # stem 432 + 32; stage 1: 3 x (2 x 2,304 + 2 x 32); stage 2: 4,608 + 9,216 + 128 + shortcut
  # 512 + 64, then 2 x (2 x 9,216 + 128); stage 3: 18,432 + 36,864 + 256 + shortcut 2,048 + 128,
  # then 2 x (2 x 36,864 + 256); linear 650. ResNet-20's 0.27M (He et al. 2016).
  assert _count(model, nnx.Param) == 272_474
  assert len(model.blocks) == 9
  # Each stage after the first starts with a stride-2 block (its shortcut too).
  assert [block.conv1.strides for block in model.blocks] == (
      [(1, 1)] * 3 + [(2, 2), (1, 1), (1, 1)] * 2)



@pytest.mark.slow  # Compiles a ResNet's forward and backward passes twice.
def test_resnet_cpu_layers_compute_the_stock_function(image_shape=(28, 28, 1)):
  """Narrow and shallow (for test time), but with every kind of block: plain, downsampling
  (a stride-2 convolution, which the CPU layer runs as the stock one does)."""
  def create(kernels_setting):
    return _create('cifar_resnet', image_shape, num_classes=7, kernels=kernels_setting,
                   model_options={'cifar_resnet': {'widths': (4, 8), 'blocks_per_stage': 2}})
  stock, cpu = create('stock'), create('auto')
  assert [block.conv2.kernel.shape for block in cpu.blocks] == [(3, 3, 4, 4)] * 2 + [
      (3, 3, 8, 8)] * 2
  assert isinstance(cpu.stem, kernels.cpu.Conv) and not isinstance(stock.stem, kernels.cpu.Conv)
  x = jax.random.uniform(jax.random.key(0), (4, *image_shape))

  @nnx.jit
  def outputs_and_grads(model):
    return model(x), nnx.grad(lambda model: jnp.sin(model(x)).sum())(model)

  (cpu_out, cpu_grads), (stock_out, stock_grads) = outputs_and_grads(cpu), outputs_and_grads(stock)
  assert cpu_out.shape == (4, 7)
  np.testing.assert_allclose(cpu_out, stock_out, rtol=1e-4, atol=1e-4)  # Train mode.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
               cpu_grads, stock_grads)


def test_mlp_parameter_count():
  assert _count(_create('mlp'), nnx.Param) == (784 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)


def test_model_options_come_from_the_config():
  config = default.get_config()
  config.model_options.cnn.update(conv1_features=8, conv2_features=16, hidden_features=32,
                                  dropout_rate=0.5)
  model = _built(config)
  assert model.conv2.kernel.shape == (3, 3, 8, 16)
  assert model.linear1.kernel.shape == (7 * 7 * 16, 32)
  assert model.dropout1.rate == model.dropout2.rate == 0.5
  config.model = 'mlp'
  config.model_options.mlp.hidden_features = (64, 32, 16)
  model = _built(config)
  assert [linear.kernel.shape for linear in model.linears] == [(784, 64), (64, 32), (32, 16),
                                                               (16, 10)]


def test_cnn_train_mode_is_stochastic_and_updates_batch_stats():
  model = _create('cnn')
  x = jax.random.uniform(jax.random.key(1), (8, 28, 28, 1))
  mean_before = model.batch_norm1.mean[...].copy()
  first, second = model(x), model(x)
  assert not jnp.allclose(first, second), 'dropout should draw new masks in train mode'
  assert not jnp.allclose(model.batch_norm1.mean[...], mean_before)


def test_cnn_eval_mode_is_deterministic_and_freezes_batch_stats():
  model = _create('cnn')
  model.eval()
  x = jax.random.uniform(jax.random.key(1), (8, 28, 28, 1))
  mean_before = model.batch_norm1.mean[...].copy()
  np.testing.assert_array_equal(model(x), model(x))
  np.testing.assert_array_equal(model.batch_norm1.mean[...], mean_before)


def test_resnet_is_the_former_name_of_cifar_resnet_and_says_so(caplog):
  """'resnet' (before the ImageNet resnet18/34/50) builds the same model, with its own section
  where a saved config has one, else cifar_resnet's; one line names the new name."""
  shapes = lambda model: jax.tree.map(jnp.shape, nnx.state(model))
  new = _shapes('cifar_resnet', (32, 32, 3))
  with caplog.at_level('WARNING'):
    old = _shapes('resnet', (32, 32, 3))
  assert shapes(old) == shapes(new)
  assert [record for record in caplog.records if 'cifar_resnet' in record.getMessage()]
  narrow = default.get_config()
  narrow.model = 'resnet'
  narrow.model_options.resnet = {'widths': (4, 8), 'blocks_per_stage': 1}
  model = nnx.eval_shape(lambda: run_spec.resolve(narrow).model.build((16, 16, 3), 10,
                                                                      nnx.Rngs(0)))
  assert len(model.blocks) == 2 and model.linear.kernel.shape == (8, 10)


def _saved_before_the_rename() -> dict:
  """configs/cifar10.py's settings as a workdir saved them when the model was 'resnet'."""
  settings = run_spec.resolve(cifar10.get_config()).settings
  options = settings['model_options']
  return {**settings, 'model': 'resnet',
          'model_options': {'cnn': options['cnn'], 'mlp': options['mlp'],
                            'resnet': options['cifar_resnet']}}


def test_a_workdir_saved_with_resnet_resumes_under_either_name(tmp_path):
  workdir = str(tmp_path)
  for model in ('cifar_resnet', 'resnet'):
    workdirs.write_json(f'{workdir}/{workdirs.CONFIG_FILE}', _saved_before_the_rename())
    config = cifar10.get_config()
    config.model = model
    workdirs.check_resume_config(run_spec.resolve(config).settings, workdir, has_checkpoint=True)
  # Another model is still refused.
  workdirs.write_json(f'{workdir}/{workdirs.CONFIG_FILE}', _saved_before_the_rename())
  config = cifar10.get_config()
  config.model_options.cifar_resnet.blocks_per_stage = 2
  with pytest.raises(errors.ConfigError) as error:
    workdirs.check_resume_config(run_spec.resolve(config).settings, workdir, has_checkpoint=True)
  assert error.value.key == 'model_options.cifar_resnet.blocks_per_stage'


def test_unknown_model_and_option_are_config_errors_naming_the_key():
  with pytest.raises(errors.ConfigError) as error:
    _create('resnet5000')
  assert (error.value.key, error.value.value) == ('model', 'resnet5000')
  config = default.get_config()
  config.model_options.cnn.width = 3
  with pytest.raises(errors.ConfigError) as error:
    run_spec.resolve(config)
  assert (error.value.key, error.value.value) == ('model_options.cnn.width', 3)


@pytest.mark.slow  # Trains the recipe.
def test_cifar10_recipe_trains_on_generated_colour_images(tmp_path):
  """configs/cifar10.py (a narrower, shallower ResNet, for CPU time) on 32x32 colour shapes."""
  root = str(tmp_path / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 32, 'test': 8}, image_sizes=(32, 32),
                                   gray_every=1000, corrupt=False)
  config = cifar10.get_config()
  run_spec.resolve(config)  # The recipe itself is valid as written.
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=16,
                     eval_batch_size=24, num_epochs=5, learning_rate=0.05,
                     evaluators='loss|accuracy'))
  config.model_options.cifar_resnet.update(widths=(8, 16, 32), blocks_per_stage=1)
  metrics = train.train_and_evaluate(run_spec.resolve(config), str(tmp_path / 'workdir'))
  assert metrics['eval/accuracy'] >= 0.6, metrics  # 3 classes: chance is 1/3.
  assert metrics['train/loss_epoch'] < np.log(3), metrics


def test_mlp_input_scale_and_init_stddev_options():
  config = default.get_config()
  config.model = 'mlp'
  config.model_options.mlp.update(input_scale=255.0, init_stddev=0.01)
  model = _built(config)
  biases = jnp.concatenate([linear.bias[...] for linear in model.linears])  # 1,034 values.
  for values in (*(linear.kernel[...] for linear in model.linears), biases):  # N(0, 0.01^2).
    assert abs(float(values.std()) - 0.01) < 0.001 and abs(float(values.mean())) < 0.001
  plain = default.get_config()
  plain.model = 'mlp'
  unscaled = _built(plain)
  nnx.update(unscaled, nnx.state(model))
  images = np.random.default_rng(0).random((2, 28, 28, 1), np.float32)
  np.testing.assert_allclose(model(images), unscaled(images * 255.0), rtol=1e-5, atol=1e-5)

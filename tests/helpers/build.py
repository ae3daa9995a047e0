"""Building what a test trains or reads, as the app builds it: data, a training state and its
train step, random batches."""

from flax import nnx
import numpy as np

from configs import default
from data_sources import base
import input_pipeline
import kernels
import models
from backbones import weights
from training import init_from
from training import run_spec
from training import state as state_lib


INFO = base.DatasetInfo(name='mnist', image_shape=(28, 28, 1), num_classes=10,
                        num_train_examples=3200, num_eval_examples=250)


def create(**overrides):
  """A training state and its train step for the default config with `overrides`."""
  config = default.get_config()
  config.update(overrides)
  state = create_state(config, INFO, steps_per_epoch=100)
  run = run_spec.resolve(config)
  return state, state_lib.make_train_step(run.loss(INFO.num_classes), run.input.preprocess)


def model_config(name, **config_overrides):
  """`configs/default.py` training the model `name`, with `config_overrides`."""
  config = default.get_config()
  config.model = name
  config.update(config_overrides)
  return config


def build_model(config, image_shape=(28, 28, 1), num_classes=10, seed=0):
  """`config`'s model, initialised in one program (`run_once`)."""
  spec = run_spec.resolve(config).model
  return state_lib.run_once(lambda: spec.build(image_shape, num_classes, nnx.Rngs(seed)))


def create_model(name, image_shape=(28, 28, 1), num_classes=10, seed=0, **config_overrides):
  """The model `name` of `configs/default.py` with `config_overrides`, initialised."""
  return build_model(model_config(name, **config_overrides), image_shape, num_classes, seed)


def random_batch(batch_size=32, seed=0):
  rng = np.random.default_rng(seed)
  return {'image': rng.random((batch_size, 28, 28, 1), dtype=np.float32),
          'label': rng.integers(0, 10, batch_size).astype(np.int32)}


def open_data(config):
  """The data of `config`, opened as training opens it (its training and evaluation splits)."""
  run = run_spec.resolve(config)
  return input_pipeline.open_data(run.input, run.eval_splits())


def create_state(config, info, steps_per_epoch: int):
  """The initial training state of `config` for the data of `info`, as training builds it."""
  run = run_spec.resolve(config)
  return state_lib.create(run.model, info, run.optimization,
                          run.optimization.learning_rate_schedule(steps_per_epoch),
                          seed=run.seed, ema_decay=run.ema_decay)


def open_source(config):
  """The data source that `config` names, opened with its options."""
  return run_spec.resolve(config).input.source()


def create_backbone(name: str, image_shape=(224, 224, 3), num_classes=7,
                    layers: kernels.Layers = kernels.STOCK_LAYERS, depth: int | None = None,
                    **options) -> nnx.Module:
  """Our `name` through the registry, initialised in one program compiled at XLA's lowest
  optimisation level (`state_lib.run_once`): several times faster than initialised op by op.
  With `depth`, a ViT of that many blocks (timm's `depth` argument), the rest as registered."""
  factory = models.MODELS.entry(name).factory
  if depth is not None:
    factory = type(factory.__name__, (factory,), {'depth': depth})
  return state_lib.run_once(lambda: factory(image_shape, num_classes, layers=layers,
                                            rngs=nnx.Rngs(0), **options))


def load_weights(model: nnx.Module, model_name: str, path: str):
  """Loads the PyTorch weights that config.init_from=`path` names (a file, Hub name, URL or
  torchvision name) into `model`, as a run does: parsed, downloaded, converted. Returns the
  names loaded and the others."""
  return weights.load_pretrained(model, model_name, init_from.parse(path).file, path=path)


def read_weights(path: str):
  """The state_dict that config.init_from=`path` names, downloaded first if remote."""
  return weights.read_state_dict(init_from.parse(path).file, path)

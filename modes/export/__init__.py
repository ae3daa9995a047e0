"""Export for serving: a checkpoint's model, in eval mode, with its preprocessing and the
workdir's fitted temperature, in the format of the runtime that serves it.

    python main.py --workdir=runs/mnist --mode=export [--export_format=FORMAT]

Every format takes uint8 images (batch, height, width, channels), pixels 0-255, and returns
float32 logits (batch, num_classes) divided by the temperature (training/calibration.py; 1.0
when none was fitted). The JAX function exported is the same for all (`Classifier`): the scale
stage of `config.preprocess` (uint8 -> float32, then normalize/value_range), the model, the
temperature. A format that takes images of any size (`Format.any_size`: the SavedModel) runs
eval's resize and crop inside; the others take the model-size image, the image after them.
`Classifier.preparation` writes those ops in `config.preprocess`'s language (e.g.
`resize_small(235, interpolation='bicubic')|central_crop(224)`), which the model card
(`preprocessing.prepare`) and the logged line name; docs/export.md applies them in 3 lines.
Every format's batch size is free. Each export is checked with its own runtime against the JAX
model on probe images prepared as it takes them (`check`), and gets a model card next to it
(model_card.py).

The formats are plug-ins of `FORMATS`, one module each in this package (saved_model.py,
onnx.py, tflite.py, stablehlo.py): a `Format` subclass registered under its --export_format
name declares its directory and file, how to write it, how its runtime runs it and its
model-card fields. A new format is one new file here, or one module outside the tree that
registers its `Format` and is imported before the export (e.g. by the config file).
"""

import dataclasses
import os
import shutil

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from core import errors
from core import registry
from data_sources import base
import modes
from modes import model_card
import preprocessing
from training import calibration
from training import run_spec

FORMATS = registry.Registry('export format', key='export_format', package='modes.export')
DEFAULT_FORMAT = 'saved_model'
# Where the formats that carry StableHLO run: lowered for both, whichever machine exports.
PLATFORMS = ('cpu', 'cuda')
_PROBE_IMAGES = 4  # Random images that each export is checked on.
_PROBE_DETAIL = 4  # Their random colours on a grid of this size, smoothly resized.
_TOLERANCE = 1e-3  # Of the runtime's logits against JAX's, relative to the logits' scale.


@dataclasses.dataclass(frozen=True)
class Classifier:
  """A checkpoint's model as one JAX function of its weights and uint8 model-size images: the
  scale stage, the model, the temperature."""
  info: base.DatasetInfo
  step: int
  preprocess: preprocessing.Preprocessing
  temperature: float
  graphdef: nnx.GraphDef
  treedef: jax.tree_util.PyTreeDef
  weights: list[np.ndarray]  # Params and BatchStats, flat (an nnx.List's keys are integers).
  names: list[str]  # Each weight's path, e.g. 'blocks/0/conv1/kernel'.
  rest: nnx.State

  def logits(self, weights: list, images: jax.Array) -> jax.Array:
    model = nnx.merge(self.graphdef, nnx.State(jax.tree.unflatten(self.treedef, weights)),
                      self.rest)
    return model(self.preprocess.scale(images)).astype(jnp.float32) / np.float32(
        self.temperature)

  def closed(self, images: jax.Array) -> jax.Array:
    """`logits` with the weights as constants, for the formats that embed them."""
    return self.logits(self.weights, images)

  def images_spec(self, batch) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch, *self.info.image_shape), jnp.uint8)

  @property
  def preparation(self) -> str:
    """The image ops, in `config.preprocess`'s language, that make an image of any size the
    model-size image (eval's stages 1 and 2): the fixed-size formats' users apply them, the
    any-size formats run them inside. Without such ops, other sizes are stretched."""
    height, width, _ = self.info.image_shape
    return self.preprocess.resize_spec or (f'resize({height})' if height == width else
                                           f'stretched to {height}x{width}')

  def prepare(self, images: np.ndarray) -> np.ndarray:
    """uint8 images of one size made model-size images, as eval and predict make them."""
    return self.preprocess.resize(tf.constant(images), self.info.image_shape[:2]).numpy()


class Format:
  """An export format, registered in `FORMATS` under its --export_format name:

      @export.FORMATS.register('my_format')
      class MyFormat(export.Format):
        directory = 'export_my_format'
        file = 'model.bin'
        usage = 'my_runtime.load(path)(images)'
        def write(self, classifier, path): ...
        def run(self, path, images): ...

  Its class attributes declare where it goes and what it takes; `write` is its converter and
  `run` its runtime (which `check` runs on probe images); `card_fields` adds its own entries to
  the model card (of the export at its path).
  """
  directory: str  # In the workdir.
  file: str | None = None  # The model's file in `directory`; None: the directory is the model.
  # Whether it takes images of any size (eval's resize and crop inside) or model-size images.
  any_size: bool = False
  usage: str  # The Python line that runs the export at `path` on uint8 `images`, for the card.

  def write(self, classifier: Classifier, path: str) -> None:
    """Writes the classifier at `path`."""
    raise NotImplementedError

  def run(self, path: str, images: np.ndarray) -> np.ndarray:
    """The logits of uint8 `images` from the export at `path`, run by the format's runtime."""
    raise NotImplementedError

  def card_fields(self, classifier: Classifier, path: str) -> dict:
    """The format's own model-card entries (JSON values) for its export at `path`, under
    'format_details'."""
    del classifier, path  # Unused: no entries of its own.
    return {}


def format_named(name: str) -> Format:
  """The format registered as `name`; a `FlagError` naming the registered ones otherwise."""
  if name not in FORMATS.names():
    raise errors.FlagError(f'Unknown --export_format={name!r}: use one of {FORMATS.names()}.',
                           flag='export_format', value=name)
  return FORMATS.entry(name).factory()


def require(module: str, export_format: str):
  """The optional package `module` that a format needs, imported; a `FlagError` naming it and
  the format if it is not installed."""
  return errors.require(module, f'--export_format={export_format}', errors.FlagError,
                        flag='export_format', value=export_format)


def load_classifier(run: run_spec.Run, workdir: str, checkpoint: str = 'latest') -> Classifier:
  """The `Classifier` of a checkpoint (--checkpoint) of `workdir`."""
  # The stock layers: the XLA:CPU ones (kernels/cpu.py) choose their algorithm from the batch
  # size while tracing, which a batch of symbolic size cannot answer; both compute the same
  # function of the same weights.
  run = dataclasses.replace(run, model=dataclasses.replace(run.model, kernels='stock'))
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)
  return classifier_of(model, info, run.input.preprocess,
                       calibration.saved_temperature(workdir, run.temperature_scaling), step)


def classifier_of(model: nnx.Module, info: base.DatasetInfo,
                  preprocess: preprocessing.Preprocessing, temperature: float = 1.0,
                  step: int = 0) -> Classifier:
  """The `Classifier` of `model` (in eval mode, built from the stock layers) with its scale
  stage `preprocess` and `temperature`."""
  graphdef, weights, rest = nnx.split(model, (nnx.Param, nnx.BatchStat), ...)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(weights))
  return Classifier(
      info=info, step=step, preprocess=preprocess, temperature=temperature,
      graphdef=graphdef, treedef=treedef,
      weights=[np.asarray(value) for _, value in with_paths],
      names=[jax.tree_util.keystr(path, simple=True, separator='/') for path, _ in with_paths],
      rest=rest)


def export(run: run_spec.Run, workdir: str, export_format: str = DEFAULT_FORMAT,
           checkpoint: str = 'latest') -> str:
  """Writes a checkpoint's model (--checkpoint) in `export_format` with its model card into
  the workdir and logs what it takes; returns the model's path (its file or directory)."""
  exporter = format_named(export_format)
  classifier = load_classifier(run, workdir, checkpoint)
  directory = os.path.join(os.path.abspath(workdir), exporter.directory)
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, exporter.file) if exporter.file else directory
  exporter.write(classifier, path)
  try:
    difference = check(classifier, export_format, exporter, path)
  except errors.DataError:
    # A model that does not compute the JAX model's logits is not left behind.
    if os.path.isdir(path):
      shutil.rmtree(path)
    else:
      os.remove(path)
    raise
  model_card.write(directory, workdir, export_format=export_format, model_path=path,
                   usage=exporter.usage, format_details=exporter.card_fields(classifier, path),
                   step=classifier.step, info=classifier.info, any_size=exporter.any_size,
                   preprocess=classifier.preprocess.spec, preparation=classifier.preparation,
                   temperature=classifier.temperature)
  height, width, channels = classifier.info.image_shape
  size = (f'of any size (made {height}x{width} inside by {classifier.preparation})'
          if exporter.any_size else f'of {height}x{width}: prepare them first by '
          f'{classifier.preparation}, as eval does (docs/export.md)')
  logging.info("Exported the model of step %d as %s to %s. It takes uint8 images (batch, "
               "height, width, %d), pixels 0-255, %s, and returns logits divided by the "
               "temperature %.4g; its runtime gives the JAX model's logits (max difference "
               '%.2g). Model card: %s.', classifier.step, export_format, path, channels, size,
               classifier.temperature, difference,
               os.path.join(directory, model_card.MARKDOWN_FILE))
  return path


def check(classifier: Classifier, export_format: str, exporter: Format, path: str) -> float:
  """The export's largest logit difference from the JAX model's on random probe images, each
  as the format takes it; a `DataError` naming the format when its runtime disagrees (a
  converter's fault).

  An any-size format's probes are of another size than the model's, and the JAX model gets
  them made model-size images by eval's resize and crop (`Classifier.prepare`), as the format
  makes them inside; a fixed-size format's probes are model-size images.

  The probes are smooth (random colours on a coarse grid, resized), as photos are. Uniform
  noise is far from any training image: a fine-tuned model's BatchNorm statistics can amplify
  it to logits in the thousands (EfficientNet-B0 after a few steps: 6e3), where float32's
  rounding alone moves them by more than the tolerance (the JAX model jitted and eager differ
  by 150), and a correct export would be refused.
  """
  height, width, channels = classifier.info.image_shape
  size = ((height + height // 2 + 1, width + width // 3 + 2) if exporter.any_size
          else (height, width))
  coarse = np.random.default_rng(0).integers(
      0, 256, (_PROBE_IMAGES, _PROBE_DETAIL, _PROBE_DETAIL, channels), np.uint8)
  images = tf.cast(tf.round(tf.image.resize(coarse, size)), tf.uint8).numpy()
  prepared = classifier.prepare(images) if exporter.any_size else images
  # On the CPU, where the formats' runtimes run, both sides: the JAX model on a TPU would
  # compute float32 matmuls in bfloat16 passes (JAX's default precision there), and a StableHLO
  # export runs only on the platforms it was lowered for (`PLATFORMS`).
  with jax.default_device(_cpu_or_default_device()):
    expected = np.asarray(jax.jit(classifier.closed)(prepared))
    try:
      difference = float(np.abs(exporter.run(path, images) - expected).max())
      reason = f"its logits differ from the JAX model's by up to {difference:.3g}"
    except errors.UserError:
      raise
    except Exception as error:  # pylint: disable=broad-except  (the runtime's, in one line)
      difference, reason = np.inf, f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
  if not difference <= _TOLERANCE * max(1.0, float(np.abs(expected).max())):  # NaN too.
    raise errors.DataError(
        f'The {export_format} export of this model at {path} does not run as the JAX model '
        f'({reason}): this model has a layer the converter does not carry; use another '
        f'--export_format (one of {FORMATS.names()}).', what=path, export_format=export_format)
  return difference


def _cpu_or_default_device() -> jax.Device:
  """This process's first CPU device; its default device where $JAX_PLATFORMS leaves the CPU
  out (e.g. 'cuda', whose exports are lowered for it too)."""
  try:
    return jax.local_devices(backend='cpu')[0]
  except RuntimeError:  # JAX has no CPU backend in this process.
    return jax.local_devices()[0]

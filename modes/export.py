"""Export for serving: a checkpoint's model, in eval mode, with its preprocessing and the
workdir's fitted temperature, in the format of the runtime that serves it.

    python main.py --workdir=runs/mnist --mode=export [--export_format=onnx|tflite|stablehlo]

Every format takes uint8 images (batch, height, width, channels), pixels 0-255, and returns
float32 logits (batch, num_classes) divided by the temperature (training/calibration.py; 1.0
when none was fitted). The JAX function exported is the same for all: the scale stage of
`config.preprocess` (uint8 -> float32, then normalize/value_range), the model, the temperature.

  saved_model  `<workdir>/export/`, for TensorFlow (Serving): images of any size, resized as
               training did by the TF ops of `config.preprocess`'s image stage, in front of the
               model converted with jax2tf (native serialization, for CPU and CUDA). Signatures:
               serving_default (`logits`); classify (`class`, `probability`); class_names.
  onnx         `<workdir>/export_onnx/model.onnx` through jax2onnx, for ONNX Runtime;
  tflite       `<workdir>/export_tflite/model.tflite` through TF's LiteRT converter;
  stablehlo    `<workdir>/export_stablehlo/model.stablehlo`: `jax.export`'s serialized bytes
               (`jax.export.deserialize(data).call(images)`), for CPU and CUDA.
The last three take the model-size image: the image after the resize and centre crop of the
eval preprocessing, `config.preprocess`'s image stage and its crop's eval stand-in, written as
ops in `Classifier.preparation` (e.g. `resize_small(235, interpolation='bicubic')|
central_crop(224)`), which the model card (`preprocessing.prepare`) and the logged line name: their resize ops are TF
ops, which these runtimes cannot run. Every format's batch size is free. Each export is checked
with its own runtime against the JAX model on probe images prepared as the format takes them
(the SavedModel's of another size than the model's), and writes a model card next to it
(model_card.py).
"""

import dataclasses
import logging as python_logging
import os
import tempfile

from absl import logging
from flax import nnx
import jax
from jax.experimental import jax2tf
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from core import errors
from data_sources import base
import modes
from modes import model_card
import preprocessing
from training import calibration
from training import run_spec

FORMATS = ('saved_model', 'onnx', 'tflite', 'stablehlo')
EXPORT_DIR = 'export'  # The SavedModel's directory in the workdir; the others add _<format>.
FILES = {'onnx': 'model.onnx', 'tflite': 'model.tflite', 'stablehlo': 'model.stablehlo'}
# Where the SavedModel and StableHLO run: lowered for both, whichever machine exports.
PLATFORMS = ('cpu', 'cuda')
_PROBE_IMAGES = 4  # Random images that each export is checked on.
_TOLERANCE = 1e-3  # Of the runtime's logits against JAX's, relative to the logits' scale.


@dataclasses.dataclass(frozen=True)
class Classifier:
  """A checkpoint's model as one JAX function of its weights and uint8 images of the training
  size: the scale stage, the model, the temperature."""
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
    SavedModel runs them inside. Without such ops, images of another size are stretched."""
    height, width, _ = self.info.image_shape
    return self.preprocess.resize_spec or (f'resize({height})' if height == width else
                                           f'stretched to {height}x{width}')

  def prepare(self, images: np.ndarray) -> np.ndarray:
    """uint8 images of one size made model-size images, as eval and predict make them."""
    return self.preprocess.resize(tf.constant(images), self.info.image_shape[:2]).numpy()


def load_classifier(run: run_spec.Run, workdir: str, checkpoint: str = 'latest') -> Classifier:
  """The `Classifier` of a checkpoint (--checkpoint) of `workdir`."""
  # The stock layers: the XLA:CPU ones (kernels/cpu.py) choose their algorithm from the batch
  # size while tracing, which a batch of symbolic size cannot answer; both compute the same
  # function of the same weights.
  run = dataclasses.replace(run, model=dataclasses.replace(run.model, cpu_kernels='off'))
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)
  graphdef, weights, rest = nnx.split(model, (nnx.Param, nnx.BatchStat), ...)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(weights))
  return Classifier(
      info=info, step=step, preprocess=run.input.preprocess,
      temperature=calibration.saved_temperature(workdir, run.temperature_scaling),
      graphdef=graphdef, treedef=treedef,
      weights=[np.asarray(value) for _, value in with_paths],
      names=[jax.tree_util.keystr(path, simple=True, separator='/') for path, _ in with_paths],
      rest=rest)


def export(run: run_spec.Run, workdir: str, export_format: str = 'saved_model',
           checkpoint: str = 'latest') -> str:
  """Writes a checkpoint's model (--checkpoint) in `export_format` with its model card into
  the workdir; returns the path of the model (the SavedModel's directory, or the file)."""
  if export_format not in FORMATS:
    raise errors.FlagError(f'Unknown --export_format={export_format!r}: use one of '
                           f'{list(FORMATS)}.', flag='export_format', value=export_format)
  classifier = load_classifier(run, workdir, checkpoint)
  directory = os.path.join(os.path.abspath(workdir), EXPORT_DIR + (
      '' if export_format == 'saved_model' else f'_{export_format}'))
  os.makedirs(directory, exist_ok=True)
  if export_format == 'saved_model':
    path = directory
    saved_model(classifier, path)
  else:
    path = os.path.join(directory, FILES[export_format])
    {'onnx': onnx, 'tflite': tflite, 'stablehlo': stablehlo}[export_format](classifier, path)
  try:
    difference = check(classifier, export_format, path)
  except errors.DataError:
    if os.path.isfile(path):
      os.remove(path)  # A model that does not compute the JAX model's logits is not left behind.
    raise
  any_size = export_format == 'saved_model'
  model_card.write(directory, workdir, export_format=export_format, model_path=path,
                   step=classifier.step, info=classifier.info, any_size=any_size,
                   preprocess=classifier.preprocess.spec, preparation=classifier.preparation,
                   temperature=classifier.temperature)
  height, width, channels = classifier.info.image_shape
  size = (f'of any size, made {height}x{width} inside by {classifier.preparation}' if any_size
          else f'of {height}x{width}, prepared first by {classifier.preparation} as eval does '
          '(docs/export.md)')
  logging.info('Exported the model of the checkpoint at step %d to %s.', classifier.step, path)
  print(f'Exported the model of step {classifier.step} as {export_format} to {path}. It takes '
        f'uint8 images (batch, height, width, {channels}), pixels 0-255, {size} '
        f'(config.preprocess={classifier.preprocess.spec!r}) and returns logits divided by the '
        f'temperature {classifier.temperature:.4g}; checked against the JAX model (max '
        f'|logit difference| {difference:.2g}). Model card: '
        f'{os.path.join(directory, model_card.MARKDOWN_FILE)}.')
  return path


def _tf_module(classifier: Classifier, any_size: bool, platforms=PLATFORMS) -> tf.Module:
  """The classifier as a tf.Module: weights as TF variables, the JAX function through jax2tf;
  with `any_size`, the image stage of config.preprocess (TF ops) in front."""
  module = tf.Module()
  module.weights = [tf.Variable(value, trainable=False, name=name)
                    for value, name in zip(classifier.weights, classifier.names)]
  converted = jax2tf.convert(classifier.logits, polymorphic_shapes=[None, '(batch, ...)'],
                             with_gradient=False, native_serialization_platforms=platforms)
  height, width, channels = classifier.info.image_shape
  images_spec = tf.TensorSpec((None, None if any_size else height, None if any_size else width,
                               channels), tf.uint8, name='images')

  def predict(images):
    if any_size:
      images = tf.ensure_shape(classifier.preprocess.resize(images, (height, width)),
                               (None, height, width, channels))
    return {'logits': converted(list(module.weights), images)}

  module.predict = tf.function(predict, autograph=False, input_signature=[images_spec])
  names = tf.constant(classifier.info.class_names)

  def classify(images):
    probabilities = tf.nn.softmax(module.predict(images)['logits'])
    return {'class': tf.gather(names, tf.argmax(probabilities, axis=-1)),
            'probability': tf.reduce_max(probabilities, axis=-1)}

  module.classify = tf.function(classify, autograph=False, input_signature=[images_spec])
  module.class_names = tf.function(lambda: {'class_names': names}, autograph=False,
                                   input_signature=[])
  return module


def saved_model(classifier: Classifier, path: str) -> None:
  module = _tf_module(classifier, any_size=True)
  tf.saved_model.save(module, path, signatures={'serving_default': module.predict,
                                                'classify': module.classify,
                                                'class_names': module.class_names})


def tflite(classifier: Classifier, path: str) -> None:
  """LiteRT's converter reads a SavedModel: the fixed-size one, lowered for the CPU, where
  LiteRT runs it (its converter turns the jax2tf call into LiteRT ops)."""
  module = _tf_module(classifier, any_size=False, platforms=('cpu',))
  with tempfile.TemporaryDirectory() as directory:
    tf.saved_model.save(module, directory, signatures={'serving_default': module.predict})
    converted = tf.lite.TFLiteConverter.from_saved_model(directory).convert()
  with open(path, 'wb') as file:
    file.write(converted)


def onnx(classifier: Classifier, path: str) -> None:
  """Through jax2onnx, from the function's jaxpr (lax primitives only): jax2onnx's own
  replacements of flax layers, patched in while it traces, fail on this JAX version."""
  jax2onnx = _require('jax2onnx', 'onnx')
  # Its dm_pix plugins fail to import on this JAX version (unused here), each with a traceback.
  python_logging.getLogger('jax2onnx').setLevel(python_logging.ERROR)
  batch, = jax.export.symbolic_shape('batch')
  spec = classifier.images_spec(batch)
  jaxpr = jax.make_jaxpr(classifier.closed)(spec)
  jax2onnx.to_onnx(lambda images: _with_onnx_max_pools(jaxpr, images)[0],
                   [spec], model_name='classifier', input_names=['images'],
                   output_names=['logits'], return_mode='file', output_path=path)


def _with_onnx_max_pools(jaxpr: jax.extend.core.ClosedJaxpr, *args) -> list:
  """`jaxpr` evaluated on `args` (as `jax.core.eval_jaxpr`), its NHWC max pools written as
  ONNX Runtime runs them.

  jax2onnx writes a max pool (`reduce_window_max`) as one ONNX MaxPool whose spatial axes are
  all the operand's: an NHWC pool (a ResNet's stem) becomes a 4-D MaxPool, and ONNX Runtime
  runs at most 3-D ones. With batch and channels folded into one leading axis (N*C, H, W) the
  same pool is a 3-D MaxPool with a window of 1 on that axis: the same maxima.
  """
  env = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts)) | dict(zip(jaxpr.jaxpr.invars, args))
  read = lambda var: var.val if isinstance(var, jax.extend.core.Literal) else env[var]
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


def stablehlo(classifier: Classifier, path: str) -> None:
  batch, = jax.export.symbolic_shape('batch')
  exported = jax.export.export(jax.jit(classifier.closed), platforms=PLATFORMS)(
      classifier.images_spec(batch))
  with open(path, 'wb') as file:
    file.write(exported.serialize())


def run_exported(export_format: str, path: str, images: np.ndarray) -> np.ndarray:
  """The logits of uint8 `images` from the export at `path`, run by its format's runtime."""
  if export_format == 'saved_model':
    return tf.saved_model.load(path).signatures['serving_default'](
        images=tf.constant(images))['logits'].numpy()
  if export_format == 'onnx':
    session = _require('onnxruntime', export_format).InferenceSession(path)
    return session.run(['logits'], {'images': images})[0]
  if export_format == 'tflite':
    interpreter = _require('ai_edge_litert.interpreter', export_format).Interpreter(
        model_path=path)
    return interpreter.get_signature_runner()(images=images)['logits']
  with open(path, 'rb') as file:
    return np.asarray(jax.export.deserialize(file.read()).call(images))


def _require(module: str, export_format: str):
  return errors.require(module, f'--export_format={export_format}', errors.FlagError,
                        flag='export_format', value=export_format)


def check(classifier: Classifier, export_format: str, path: str) -> float:
  """The export's largest logit difference from the JAX model's on random probe images, each
  as the format takes it; a `DataError` naming the format when its runtime disagrees (a
  converter's fault).

  The SavedModel's probes are of another size than the model's, and the JAX model gets them
  made model-size images by eval's resize and crop (`Classifier.prepare`), as the SavedModel
  makes them inside; the fixed-size formats' probes are model-size images.
  """
  height, width, channels = classifier.info.image_shape
  any_size = export_format == 'saved_model'
  size = (height + height // 2 + 1, width + width // 3 + 2) if any_size else (height, width)
  images = np.random.default_rng(0).integers(0, 256, (_PROBE_IMAGES, *size, channels), np.uint8)
  prepared = classifier.prepare(images) if any_size else images
  expected = np.asarray(jax.jit(classifier.closed)(prepared))
  try:
    difference = float(np.abs(run_exported(export_format, path, images) - expected).max())
    reason = f"its logits differ from the JAX model's by up to {difference:.3g}"
  except errors.UserError:
    raise
  except Exception as error:  # pylint: disable=broad-except  (the runtime's, reported in one line)
    difference, reason = np.inf, f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
  if difference > _TOLERANCE * max(1.0, float(np.abs(expected).max())):
    raise errors.DataError(
        f'The {export_format} export of this model at {path} does not run as the JAX model '
        f'({reason}): this model has a layer the converter does not carry; use '
        '--export_format=saved_model or stablehlo.', what=path, export_format=export_format)
  return difference


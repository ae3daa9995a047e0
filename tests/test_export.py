"""Export (modes/export/): every format, run by its own runtime on uint8 image files, gives
predict's classes; every registered model exports as a SavedModel with the JAX model's logits;
the model card says what the model takes and where it came from."""

import csv
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap

from flax import nnx
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf

from backbones import resnet
from backbones import weights as weights_lib
from configs import default
from tests.helpers import build
from tests.helpers import small_backbones
from tests.helpers.optional import requires_extras
from core import errors
from data_sources import base
import sample_folders
import image_folders
import models
import modes
from modes import export
from modes import model_card
from modes.export import stablehlo
from modes import predict
import preprocessing
from training import calibration
from training import checkpointing
from training import provenance
from training import run_spec
from training import summaries
from training import workdirs

SIZE = 16
CLASSES = ('centre', 'left half', 'top')
TEMPERATURE = 2.0
# The optional extras each format needs to export and run (the others come with the app).
EXTRAS = {'saved_model': (), 'onnx': ('jax2onnx', 'onnxruntime'), 'tflite': ('ai_edge_litert',),
          'stablehlo': ()}
BUILT_IN = tuple(EXTRAS)  # The formats of modes/export/ (a test registers one more).
def _family(name: str) -> type:
  """The class that model `name` is a variant of: the first of its classes below nnx.Module
  (its own class for a model registered alone)."""
  classes = models.MODELS.entry(name).factory.__mro__
  return classes[classes.index(nnx.Module) - 1]


def _config(root: str, model: str = 'cnn', image_size: int = SIZE):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, eval_split='test', batch_size=4,
                     eval_batch_size=4, model=model, preprocess=f'resize({image_size})',
                     temperature_scaling=True))  # `_make_workdir` writes a fitted temperature.
  config.model_options.cnn.update(conv1_features=4, conv2_features=8, hidden_features=16)
  return config


def _make_workdir(workdir: str, config, image_shape=(SIZE, SIZE, 3)) -> run_spec.Run:
  """A workdir as training leaves it, without training: the saved config, data info, a
  checkpoint of the initial state, a fitted temperature, metrics and provenance."""
  run = run_spec.resolve(config)
  info = base.DatasetInfo(name='shapes', image_shape=image_shape, num_classes=len(CLASSES),
                          num_train_examples=8, num_eval_examples=4, class_names=CLASSES)
  os.makedirs(workdir, exist_ok=True)
  workdirs.check_resume_config(run.settings, workdir, has_checkpoint=False)
  workdirs.save_info(workdir, info)
  checkpoints = checkpointing.Checkpoints(workdir)
  checkpoints.save(1, build.create_state(config, info, 1),
                   {'epoch': 0, 'step_in_epoch': 1, 'steps_per_epoch': 1, 'hooks': {}})
  checkpoints.close()
  with open(os.path.join(workdir, calibration.TEMPERATURE_FILE), 'w', encoding='utf-8') as file:
    json.dump({'temperature': TEMPERATURE}, file)
  with open(os.path.join(workdir, summaries.METRICS_FILE), 'w', encoding='utf-8') as file:
    file.write(json.dumps({'step': 1, 'eval/accuracy': 0.5}) + '\n')
    file.write(json.dumps({'step': 1, 'test/accuracy': 0.25}) + '\n')
  return run


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A small CNN's workdir, and image files of the training size and of other sizes."""
  root = str(tmp_path_factory.mktemp('data') / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 4, 'test': 2}, corrupt=False)
  directory = str(tmp_path_factory.mktemp('workdir'))
  run = _make_workdir(directory, _config(root))
  provenance.record_start(directory, run, modes.dataset_info(run, directory))
  rng = np.random.default_rng(0)
  files = {}
  for height, width in ((SIZE, SIZE), (2 * SIZE, 2 * SIZE), (20, 30)):
    folder = tmp_path_factory.mktemp(f'images_{height}x{width}')
    for index, name in enumerate(CLASSES * 2):
      path = str(folder / f'{index}.png')
      image_folders.shape_image(rng, name, (height, width), colour=True).save(path)
    files[height, width] = str(folder)
  return run, directory, files


def _predicted(run, directory: str, folder: str) -> dict[str, str]:
  """{file: class} of --mode=predict's code path."""
  with open(predict.predict(run, directory, folder), newline='', encoding='utf-8') as file:
    return {row['file']: row['class'] for row in csv.DictReader(file)}


# A fresh python with only the format's runtime imported: the classes of the files given.
_RUN = {
    'saved_model': """
        import tensorflow as tf
        model = tf.saved_model.load(path)
        logits = [model.signatures['serving_default'](images=tf.constant(image[None]))['logits'][0]
                  for image in images]""",
    'onnx': """
        import onnxruntime
        session = onnxruntime.InferenceSession(path)
        logits = session.run(['logits'], {'images': np.stack(images)})[0]""",
    'tflite': """
        from ai_edge_litert.interpreter import Interpreter
        runner = Interpreter(model_path=path).get_signature_runner()
        logits = runner(images=np.stack(images))['logits']""",
    'stablehlo': """
        import jax
        with open(path, 'rb') as file:
          logits = jax.export.deserialize(file.read()).call(np.stack(images))""",
}


# docs/export.md's preparation of a file for a fixed-size format, as its model card names it.
_PREPARE = """
    import preprocessing, tensorflow as tf  # this repository's ops, as predict runs them
    prepare = preprocessing.parse(preparation).resize
    images = [prepare(tf.io.decode_image(tf.io.read_file(file), 3, expand_animations=False))
              .numpy() for file in files]"""


def _runtime_logits(export_format: str, path: str, files: list[str],
                    preparation: str | None = None) -> np.ndarray:
  """The logits of the files from the export at `path`, run by its runtime in a fresh python
  (with the repository on its path when `preparation` names the ops that prepare the images)."""
  script = textwrap.dedent("""
      import json
      import sys
      import numpy as np
      from PIL import Image
      path, preparation, files = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
      images = [np.asarray(Image.open(file).convert('RGB')) for file in files]
      """) + (textwrap.dedent(_PREPARE) if preparation else '') + textwrap.dedent(
          _RUN[export_format]) + textwrap.dedent("""
      np.save(sys.stdout.buffer, np.asarray(logits))
      """)
  result = subprocess.run([sys.executable, '-c', script, path, json.dumps(preparation), *files],
                          capture_output=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  return np.load(io.BytesIO(result.stdout))


def _runtime_classes(export_format: str, path: str, files: list[str],
                     preparation: str | None = None) -> list[str]:
  return [CLASSES[int(label)] for label in
          _runtime_logits(export_format, path, files, preparation).argmax(-1)]


@pytest.mark.parametrize('export_format', BUILT_IN)
def test_each_format_in_its_runtime_classifies_as_predict(workdir, export_format):
  requires_extras(*EXTRAS[export_format])
  run, directory, files = workdir
  path = export.export(run, directory, export_format)
  sizes = list(files) if export_format == 'saved_model' else [(SIZE, SIZE)]
  predicted = {}
  for size in sizes:
    predicted.update(_predicted(run, directory, files[size]))
  paths = sorted(predicted)
  # The files of every size in one fresh process: each start imports the runtime again.
  assert _runtime_classes(export_format, path, paths) == [predicted[file] for file in paths]
  card = json.loads(open(os.path.join(os.path.dirname(path) if export_format != 'saved_model'
                                      else path, model_card.JSON_FILE)).read())
  assert card['input']['fixed_size'] == (export_format != 'saved_model')
  assert card['temperature'] == TEMPERATURE
  if export_format == 'tflite':  # What a device that runs it needs: its size and speed.
    details = card['format_details']
    assert details['file_megabytes'] == round(os.path.getsize(path) / 1e6, 3)
    assert details['interpreter_images_per_second_batch_1'] > 0
    assert details['processor'] == provenance.processor()
    text = open(os.path.join(os.path.dirname(path), model_card.MARKDOWN_FILE)).read()
    assert f"| file_megabytes | {details['file_megabytes']} |" in text


def test_exports_divide_the_logits_by_the_temperature(workdir):
  run, directory, files = workdir
  path = export.export(run, directory, 'stablehlo')
  model, _ = modes.load_model(run, directory, modes.dataset_info(run, directory))
  images = np.stack([np.asarray(Image.open(os.path.join(files[SIZE, SIZE], name)).convert('RGB'))
                     for name in sorted(os.listdir(files[SIZE, SIZE]))])
  import jax  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as file:
    served = np.asarray(jax.export.deserialize(file.read()).call(images))
  expected = np.asarray(model(run.input.preprocess.scale(images))) / TEMPERATURE
  np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


def test_model_card_says_what_the_model_takes_and_where_it_came_from(workdir):
  run, directory, _ = workdir
  path = export.export(run, directory, 'saved_model')
  card = json.loads(open(os.path.join(path, model_card.JSON_FILE)).read())
  assert card['classes'] == list(CLASSES)
  assert card['input'] == {'name': 'images', 'dtype': 'uint8', 'range': [0, 255],
                           'shape': ['batch', None, None, 3], 'fixed_size': False,
                           'training_size': [SIZE, SIZE]}
  assert card['preprocessing']['config_preprocess'] == run.input.preprocess.spec
  assert card['config'] == workdirs.saved_config(directory).to_dict()
  assert card['metrics'] == {'final': {'eval/accuracy': 0.5}, 'test': {'test/accuracy': 0.25}}
  training, = card['provenance']['training']
  assert training['data']['class_names'] == list(CLASSES)
  assert set(training['packages']) == set(provenance.PACKAGES)
  text = open(os.path.join(path, model_card.MARKDOWN_FILE)).read()
  assert 'test/accuracy' in text and 'left half' in text


def test_a_missing_runtime_is_one_line_naming_the_extra(workdir, monkeypatch):
  run, directory, _ = workdir
  monkeypatch.setitem(sys.modules, 'jax2onnx', None)  # Its import fails, as when absent.
  with pytest.raises(errors.FlagError) as error:
    export.export(run, directory, 'onnx')
  assert (error.value.flag, error.value.package) == ('export_format', 'jax2onnx')


@export.FORMATS.register('off_by_one_for_test')
class OffByOne(stablehlo.StableHLO):
  """A format plug-in whose runtime gets the logits wrong, as a faulty converter would."""
  directory = 'export_off_by_one_for_test'

  def run(self, path, images):
    return super().run(path, images) + 1


def test_a_format_whose_runtime_disagrees_is_refused_and_not_left_behind(workdir):
  run, directory, _ = workdir
  with pytest.raises(errors.DataError) as error:
    export.export(run, directory, 'off_by_one_for_test')
  assert error.value.export_format == 'off_by_one_for_test'
  assert error.value.what == os.path.join(directory, OffByOne.directory, OffByOne.file)
  assert not os.listdir(os.path.dirname(error.value.what))  # Neither the model nor a card.


def test_an_unknown_format_is_one_line_naming_the_flag(workdir):
  run, directory, _ = workdir
  with pytest.raises(errors.FlagError) as error:
    export.export(run, directory, 'pickle')
  assert (error.value.flag, error.value.value) == ('export_format', 'pickle')


@pytest.mark.slow  # Compiles several training programs.
def test_a_cropping_preprocess_exports_the_model_size_image_with_its_preparation(workdir):
  """A fixed-size format takes the image after eval's resize and centre crop: the card names
  those ops, and images prepared by them run as predict classifies the files."""
  run, directory, files = workdir
  cropping = preprocessing.parse(f'random_resized_crop({SIZE}, crop_pct=0.8)')
  run = dataclasses.replace(run, input=dataclasses.replace(run.input, preprocess=cropping))
  path = export.export(run, directory, 'stablehlo')
  card = json.loads(open(os.path.join(os.path.dirname(path), model_card.JSON_FILE)).read())
  assert card['preprocessing']['prepare'] == (
      f"resize_small({int(SIZE / 0.8)}, interpolation='bilinear')|central_crop({SIZE})")
  predicted = _predicted(run, directory, files[20, 30])
  paths = sorted(predicted)
  assert _runtime_classes('stablehlo', path, paths, card['preprocessing']['prepare']) == [
      predicted[file] for file in paths]


def _exported_models() -> list[str]:
  """Every registered model but the backbones' (exported as the small member of their family,
  tests/helpers/small_backbones.py) and former names."""
  small_families = {_family(name) for name in small_backbones.FAMILIES}
  return [name for name in models.MODELS.names()
          if name in small_backbones.FAMILIES or (
              _family(name) not in small_families
              and not models.MODELS.capability(name, 'replaced_by'))]


def _load_classifier_once(monkeypatch) -> None:
  """The checkpoint's classifier built once for a test's exports of one workdir (each export
  builds the model and restores the checkpoint again otherwise, seconds a format): the same
  weights every time."""
  load_classifier, loaded = export.load_classifier, {}

  def load_once(*args):
    if 'classifier' not in loaded:
      loaded['args'], loaded['classifier'] = args, load_classifier(*args)
    assert args == loaded['args'], (args, loaded['args'])
    return loaded['classifier']

  monkeypatch.setattr(export, 'load_classifier', load_once)


@pytest.mark.parametrize('name', _exported_models())
def test_every_model_family_exports_to_every_format_with_its_logits(name, tmp_path,
                                                                   monkeypatch):
  """Each format, run by its runtime, computes the JAX model's logits (the SavedModel on images
  of another size, made model-size by its resize inside). A model holding an nnx.List of
  blocks too (integer keys in its state)."""
  requires_extras(*(extra for extras in EXTRAS.values() for extra in extras))
  root = str(tmp_path / 'unused')
  run = _make_workdir(str(tmp_path), _config(root, model=name, image_size=32), (32, 32, 3))
  model, _ = modes.load_model(run, str(tmp_path), modes.dataset_info(run, str(tmp_path)))
  images = np.random.default_rng(0).integers(0, 256, (2, 40, 48, 3), np.uint8)
  prepared = run.input.preprocess.resize(tf.constant(images), (32, 32)).numpy()
  # Jitted: eagerly, each of the model's ops (the XLA:CPU kernels' many slices) compiles on
  # its own, most of this test's time (a small ConvNeXt: 48 s of 157).
  expected = np.asarray(nnx.jit(lambda model, images: model(images))(
      model, run.input.preprocess.scale(prepared))) / TEMPERATURE
  _load_classifier_once(monkeypatch)
  for export_format in BUILT_IN:
    path = export.export(run, str(tmp_path), export_format)
    served = export.format_named(export_format).run(
        path, images if export_format == 'saved_model' else prepared)
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-4, err_msg=export_format)


@models.MODELS.register('small_resnet_with_timm_keys_for_test', key_map=resnet.KEY_MAP,
                        layers=resnet.LAYERS)
class SmallResNetWithTimmKeys(resnet.ResNet):
  """ResNet-18's code (torch's names, timm's key map) at one basic block a stage and a few
  features after timm's 64-wide stem: timm's `ResNet(BasicBlock, (1, 1, 1, 1), channels=widths)`
  state_dict loads into it, and it compiles and converts in seconds instead of minutes."""
  block, depths, widths = resnet.BasicBlock, (1, 1, 1, 1), (64, 16, 24, 32)


def _runtimes_logits(exports: dict[str, tuple[str, str | None]],
                     files: list[str]) -> dict[str, np.ndarray]:
  """{format: the logits of the files} from each export {format: (path, preparation)}, each run
  by its format's runtime in one fresh python (the repository on its path for the ops that
  prepare the images): one start of TensorFlow for every format instead of one each."""
  script = textwrap.dedent("""
      import json
      import sys
      import numpy as np
      from PIL import Image
      exports, files = json.loads(sys.argv[1]), sys.argv[2:]
      decoded = [np.asarray(Image.open(file).convert('RGB')) for file in files]
      results = {}
      """)
  for export_format in exports:
    script += textwrap.dedent(f"""
        path, preparation = exports[{export_format!r}]
        images = decoded
        if preparation:""") + textwrap.indent(textwrap.dedent(_PREPARE), '  ') + textwrap.dedent(
            _RUN[export_format]) + textwrap.dedent(f"""
        results[{export_format!r}] = np.asarray(logits)
        """)
  script += '\nnp.savez(sys.stdout.buffer, **results)\n'
  result = subprocess.run([sys.executable, '-c', script, json.dumps(exports), *files],
                          capture_output=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  with np.load(io.BytesIO(result.stdout)) as logits:
    return {export_format: logits[export_format] for export_format in exports}


@pytest.mark.slow
def test_a_backbone_fine_tuned_from_imported_weights_exports_to_every_format(tmp_path,
                                                                            monkeypatch):
  """configs/finetune.py on a photo folder from timm's weights of a ResNet (BatchNorm
  statistics and the EMA moved by real steps; the pretrained preprocessing's centre crop at
  eval): every format, fed as its model card says (the fixed-size ones the images after its
  resize and crop), gives predict's classes and probabilities. A ResNet of one block a stage,
  timm's keys: what is tested is a fine-tuned, imported state's path through the exports, not
  ResNet-18's size (that took 156 s, this a third)."""
  requires_extras('timm', 'torch', 'safetensors',
                  *(extra for extras in EXTRAS.values() for extra in extras))
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from configs import finetune  # pylint: disable=g-import-not-at-top
  import train  # pylint: disable=g-import-not-at-top
  root = str(tmp_path / 'photos')
  # Lossless files: the runtimes' scripts decode with other libraries than predict.
  sample_folders.make_kind_folder(root, 'shapes', num_images=32, image_sizes=(40, 64),
                                  messy=False, formats=('PNG', 'BMP'))
  torch.manual_seed(0)
  widths = SmallResNetWithTimmKeys.widths
  timm_model = timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, (1, 1, 1, 1),
                                         num_classes=10, channels=widths)
  with torch.no_grad():  # Statistics as pretraining leaves them, not the initial 0 and 1.
    for module in timm_model.modules():
      if isinstance(module, torch.nn.BatchNorm2d):
        module.running_mean.uniform_(-0.5, 0.5)
        module.running_var.uniform_(0.5, 2.0)
  weights = str(tmp_path / 'resnet.safetensors')
  safetensors.torch.save_file(timm_model.state_dict(), weights)
  name = 'small_resnet_with_timm_keys_for_test'
  config = finetune.get_config()
  config.update(dict(dataset=root, init_from=weights, num_epochs=8, batch_size=8,
                     learning_rate=3e-3, warmup_epochs=0.0, train_split='train',
                     eval_split='train',
                     eval_batch_size=8, evaluators='accuracy', temperature_scaling=True,
                     model=name, preprocess="random_resized_crop(32, interpolation='bicubic')|"
                     "flip_lr|normalize('imagenet')"))
  config.model_options[name] = {'drop_path_rate': 0.05}
  run = run_spec.resolve(config)
  # The weights import: all of timm's state_dict but the head (4 classes here, not 10).
  imported = run.model.build((32, 32, 3), 4, nnx.Rngs(0))
  loaded, fresh = weights_lib.load_pretrained(imported, name, weights)
  assert len(loaded) > 40 and [name.split()[0] for name in fresh] == ['fc.bias', 'fc.kernel'], (
      loaded, fresh)
  imported = {name: np.array(variable[...])
              for name, variable in weights_lib.model_variables(imported)}
  directory = str(tmp_path / 'workdir')
  train.train_and_evaluate(run, directory)
  # A fitted temperature that leaves the probabilities apart (a model at chance on its eval
  # images fits one in the thousands: every probability 0.25 to float32's precision, classes
  # decided by rounding): eval on the training images, which 28 steps half learn.
  assert calibration.saved_temperature(directory, True) < 10
  # Real steps moved the imported BatchNorm statistics, and the EMA, which is exported.
  state = checkpointing.read_state(checkpointing.checkpoint_path(directory))
  for prefix in ('model.', 'ema.'):
    moved = {key: name for key in state for name in imported
             if key.startswith(prefix) and key.endswith(f'.{name}') and name.endswith('.mean')}
    assert sorted(moved.values()) == sorted(name for name in imported if name.endswith('.mean'))
    assert not any(np.allclose(state[key], imported[name]) for key, name in moved.items()), (
        prefix, moved)
  with open(predict.predict(run, directory, root), newline='', encoding='utf-8') as file:
    predicted = {row['file']: (row['class'], float(row['probability']))
                 for row in csv.DictReader(file)}
  files = sorted(predicted)
  names = modes.dataset_info(run, directory).class_names
  exports = {}
  _load_classifier_once(monkeypatch)
  for export_format in BUILT_IN:
    path = export.export(run, directory, export_format)
    card = json.loads(open(os.path.join(path if os.path.isdir(path) else os.path.dirname(path),
                                        model_card.JSON_FILE)).read())
    assert card['preprocessing']['prepare'] == (
        "resize_small(36, interpolation='bicubic')|central_crop(32)")
    exports[export_format] = (path, card['preprocessing']['before'] and
                              card['preprocessing']['prepare'])
  for export_format, logits in _runtimes_logits(exports, files).items():
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    assert [names[label] for label in probabilities.argmax(-1)] == [
        predicted[file][0] for file in files], export_format
    np.testing.assert_allclose(probabilities.max(-1), [predicted[file][1] for file in files],
                               atol=1e-4, err_msg=export_format)

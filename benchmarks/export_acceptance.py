"""A newcomer's path from imported weights to served models, at photo size: each backbone
fine-tuned one epoch on a generated photo folder, exported to every format, and each export
run in its own runtime on held-out photos prepared as its model card says, against predict.

    python -m benchmarks.export_acceptance --work=/tmp/export_acceptance \
      [--models=resnet18,efficientnet_b0,vit_small_patch16_224,mobilenetv3_large_100] \
      [--formats=saved_model,onnx,tflite,stablehlo] [--train_images=320] [--photos=30] \
      [--json=docs/runs/export_acceptance.json]

The folder (`data_sources.generated.make_kind_folder`, digits in random colours, 10 classes,
photos of 180-320 px in PNG/JPEG/BMP/GIF, a fifth grayscale) has `--train_images` to train on
and, from another seed, `--photos` held out in <work>/photos. No pretrained weights can be
downloaded here, so each model imports timm's model with seeded random weights, saved as
safetensors: the import, the fine-tuning (`configs/finetune.py`, BatchNorm statistics, EMA and
the pretrained preprocessing's centre crop included) and the export are the real path.

For each model, in its own workdir: `main.py --config=configs/finetune.py` trains one epoch from
the imported weights; `--mode=predict --inputs=<work>/photos` writes predict's class of each
photo; `--mode=export --export_format=F` writes each format. Then each export runs in its
runtime (`Format.run`) on the photos as docs/export.md prepares them: decoded by
`tf.io.decode_image`, and for the formats of model-size images prepared by the model card's
`preprocessing.prepare` ops; a SavedModel takes each photo as it is. Reported per model and
format: the photos whose class equals predict's, out of `--photos`, the largest difference
between predict's probability of its class and the export's, and the export's wall time; per
model, how many classes predict gave the photos (one epoch from random weights may favour few).
"""

import csv
import json
import os
import shlex
import shutil
import sys

from absl import app
from absl import flags
import numpy as np

from benchmarks import harness
from data_sources import generated

FLAGS = flags.FLAGS
flags.DEFINE_string('work', None, 'Where the folder, weights and workdirs go.')
flags.DEFINE_list('models', ['resnet18', 'efficientnet_b0', 'vit_small_patch16_224',
                             'mobilenetv3_large_100'], 'Backbones (timm names).')
flags.DEFINE_list('formats', ['saved_model', 'onnx', 'tflite', 'stablehlo'], 'Export formats.')
flags.DEFINE_integer('train_images', 320, 'Training photos (a tenth is held out for eval).')
flags.DEFINE_integer('photos', 30, 'Held-out photos that predict and every export classify.')
flags.DEFINE_string('json', None, 'Where to write the figures (optional).')
flags.mark_flag_as_required('work')
KIND = 'digits'  # 10 classes: the 30 photos are 3 of each.
PHOTO_SIZES = (180, 320)


def make_folders(root: str, photos: str) -> None:
  """The training folder and the held-out photos (another seed), unless already there."""
  if not os.path.isdir(root):
    generated.make_kind_folder(root, KIND, seed=0, num_images=FLAGS.train_images,
                               image_sizes=PHOTO_SIZES, messy=False)
  if not os.path.isdir(photos):
    generated.make_kind_folder(photos, KIND, seed=1, num_images=FLAGS.photos,
                               image_sizes=PHOTO_SIZES, messy=False, split='photos')


def weights_path(model: str) -> str:
  return os.path.join(FLAGS.work, f'{model}.safetensors')


def save_random_timm(model: str, path: str) -> None:
  """timm's `model` with seeded random weights, its state_dict saved as safetensors. Before
  anything imports TensorFlow: after it, timm's import of triton crashes."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    torch.manual_seed(0)
    safetensors.torch.save_file(timm.create_model(model, pretrained=False).state_dict(), path)


def predictions(workdir: str) -> dict[str, tuple[str, float]]:
  """predict's class of each photo and its probability, from <workdir>/predictions.csv."""
  with open(os.path.join(workdir, 'predictions.csv'), newline='', encoding='utf-8') as file:
    return {row['file']: (row['class'], float(row['probability']))
            for row in csv.DictReader(file)}


def export_probabilities(export_format: str, directory: str,
                         files: list[str]) -> tuple[list[str], np.ndarray]:
  """The classes the model card names, and each photo's softmax probabilities by the export in
  `directory`, run in its runtime on the photo as docs/export.md prepares it."""
  # pylint: disable=g-import-not-at-top  (the app's modules start TensorFlow and JAX)
  import tensorflow as tf
  from modes import export
  import preprocessing
  # pylint: enable=g-import-not-at-top
  exporter = export.format_named(export_format)
  with open(os.path.join(directory, 'model_card.json'), encoding='utf-8') as file:
    card = json.load(file)
  prepare = preprocessing.parse(card['preprocessing']['prepare']).resize
  path = os.path.join(directory, exporter.file) if exporter.file else directory
  logits = []
  for name in files:
    image = tf.io.decode_image(tf.io.read_file(name), 3, expand_animations=False)
    prepared = image if exporter.any_size else prepare(image)
    logits.append(exporter.run(path, prepared.numpy()[None])[0])
  return card['classes'], tf.nn.softmax(np.stack(logits)).numpy()


def accept(model: str, root: str, photos: str) -> dict:
  """One model's path: fine-tune, predict, export each format, compare; its row."""
  workdir = os.path.join(FLAGS.work, 'runs', model)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(os.path.dirname(workdir), exist_ok=True)
  weights = weights_path(model)
  common = [sys.executable, 'main.py', '--config=configs/finetune.py', f'--workdir={workdir}',
            f'--config.dataset={root}', f'--config.model={model}',
            f'--config.init_from={weights}', '--config.num_epochs=1']
  row = {'model': model, 'commands': {}}
  trained = harness.run_child(common, log_path=workdir + '_train.log')
  row['train_s'] = round(trained.seconds, 1)
  row['commands']['train'] = shlex.join(['python', *common[1:]])
  predicting = [*common, '--mode=predict', f'--inputs={photos}']
  row['predict_s'] = round(harness.run_child(predicting).seconds, 1)
  row['commands']['predict'] = shlex.join(['python', *predicting[1:]])
  expected = predictions(workdir)
  files = sorted(expected)
  row['predicted_classes'] = len({expected[name][0] for name in files})
  row['formats'] = {}
  for export_format in FLAGS.formats:
    exporting = [*common, '--mode=export', f'--export_format={export_format}']
    child = harness.run_child(exporting, check=False)
    figures = {'exported': child.returncode == 0, 'export_s': round(child.seconds, 1),
               'command': shlex.join(['python', *exporting[1:]])}
    if child.returncode == 0:
      from modes import export  # pylint: disable=g-import-not-at-top  (starts TensorFlow)
      classes, probabilities = export_probabilities(
          export_format, os.path.join(workdir, export.format_named(export_format).directory),
          files)
      top = probabilities.argmax(axis=1)
      figures['agree'] = sum(classes[top[k]] == expected[name][0] for k, name in enumerate(files))
      # predict's probability of its class against the export's of the same class.
      figures['max_probability_difference'] = float(max(
          abs(probabilities[k, classes.index(expected[name][0])] - expected[name][1])
          for k, name in enumerate(files)))
    else:
      figures['error'] = child.output_tail.strip().splitlines()[-1]
    row['formats'][export_format] = figures
    print(f'{model} {export_format}: {figures.get("agree", "not exported")} of {len(files)} '
          f'photos as predict ({figures["export_s"]:.0f} s)', flush=True)
  row['photos'] = len(files)
  return row


def main(argv):
  del argv
  root, photos = os.path.join(FLAGS.work, 'folder'), os.path.join(FLAGS.work, 'photos')
  make_folders(root, photos)
  for model in FLAGS.models:
    save_random_timm(model, weights_path(model))
  photos = os.path.join(photos, 'photos')  # make_kind_folder's split directory.
  print(harness.machine_line(harness.machine()), flush=True)
  rows = [accept(model, root, photos) for model in FLAGS.models]
  def cell(figures: dict, photos: int) -> str:
    if 'agree' not in figures:
      return 'not exported'
    return f'{figures["agree"]}/{photos} (±{figures["max_probability_difference"]:.1e})'
  print('Photos classified as predict classifies them (the largest difference of the '
        "probability of predict's class):")
  print(harness.markdown_table(
      ['model', 'train (s)', "predict's classes", *FLAGS.formats],
      [[row['model'], f'{row["train_s"]:.0f}', row['predicted_classes'],
        *(cell(row['formats'][name], row['photos']) for name in FLAGS.formats)]
       for row in rows], align='lrr' + 'r' * len(FLAGS.formats)))
  if FLAGS.json:
    harness.write_json(FLAGS.json, {'kind': KIND, 'train_images': FLAGS.train_images,
                                    'photos': FLAGS.photos, 'rows': rows})


if __name__ == '__main__':
  app.run(main)

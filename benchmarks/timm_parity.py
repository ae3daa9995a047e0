"""Imported weights score in the app as in timm: a timm model trained briefly in PyTorch on a
generated photo folder, saved as safetensors, evaluated by timm (its own eval transform) and by
`main.py --mode=eval` (the model's pretrained preprocessing), on the same test images.

    python -m benchmarks.timm_parity --work=/tmp/parity [--model=resnet18] [--epochs=2]
        [--out=docs/timm_parity.json]

The folder: `data_sources.generated`'s shapes (4 classes: circle, cross, square, triangle in
random colours, sizes and places) of 180-320 px, in PNG/JPEG/BMP/GIF, a fifth of them
grayscale, no damaged files (timm's ImageFolder would stop at one); `--train_images` and
`--test_images` per class, the test images drawn by another seed. torchvision's ImageFolder
is told to read the GIFs too, so both score every file.
timm trains with its own train transform (`create_transform(..., is_training=True)`), AdamW at
1e-3 (weight decay 0.05 on weights, not biases and norms), batches of 32 (`timm_training`);
the weights go to `<work>/<model>.safetensors` (`safetensors.torch.save_file(model.state_dict(),
...)`).
Prints and writes (`--out`, `harness.write_json`) both accuracies, the difference in points and
the app's command.
"""

import json
import os
import shlex
import shutil
import sys

from absl import app
from absl import flags

from benchmarks import harness
from benchmarks import timm_training
from data_sources import generated

FLAGS = flags.FLAGS
flags.DEFINE_string('work', None, 'Where the folder, the weights and the app run go.')
flags.DEFINE_string('model', 'resnet18', 'A timm model name that the app registers too.')
flags.DEFINE_integer('epochs', 2, 'Epochs of training in PyTorch.')
flags.DEFINE_integer('train_images', 130, 'Training images per class.')
flags.DEFINE_integer('test_images', 70, 'Test images per class.')
flags.DEFINE_string('out', None, 'A JSON file for the figures (optional).')
flags.mark_flags_as_required(['work'])


def make_folder(root: str) -> None:
  """root/train and root/test: generated shapes of 180-320 px."""
  classes = len(generated.KINDS['shapes'][0])
  for split, per_class, seed in (('train', FLAGS.train_images, 0), ('test', FLAGS.test_images, 1)):
    generated.make_kind_folder(root, 'shapes', seed=seed, num_images=per_class * classes,
                               image_sizes=(180, 320), messy=False, split=split)


def train_and_save(root: str, weights: str):
  """Trains the timm model on root/train; saves its state_dict; returns it in eval mode and
  its data config."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import timm.data  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  classes = sorted(os.listdir(os.path.join(root, 'train')))
  model = timm.create_model(FLAGS.model, pretrained=False, num_classes=len(classes))
  config = timm.data.resolve_data_config({}, model=model)
  timm_training.train(model, os.path.join(root, 'train'),
                      timm.data.create_transform(**config, is_training=True),
                      epochs=FLAGS.epochs, learning_rate=lambda step: 1e-3)
  safetensors.torch.save_file(model.state_dict(), weights)
  return model, config


def timm_accuracy(model, config, root: str) -> tuple[float, int]:
  """timm's evaluation: its eval transform (resolve_data_config + create_transform)."""
  import timm.data  # pylint: disable=g-import-not-at-top
  return timm_training.accuracy(model, os.path.join(root, 'test'),
                                timm.data.create_transform(**config))


def app_eval_command(root: str, weights: str, workdir: str) -> list[str]:
  return [sys.executable, 'main.py', '--mode=eval',
          '--config=configs/finetune.py', f'--workdir={workdir}',
          '--config.data_source=folder', f'--config.dataset={root}',
          '--config.eval_split=test', f'--config.model={FLAGS.model}',
          f'--config.init_from={weights}']


def app_accuracy(root: str, weights: str, workdir: str) -> float:
  """`main.py --mode=eval` of the imported weights: the accuracy in its JSON report."""
  harness.run_child(app_eval_command(root, weights, workdir))
  reports = [name for name in os.listdir(workdir)
             if name.startswith('eval_test_') and name.endswith('.json')]
  with open(os.path.join(workdir, reports[0]), encoding='utf-8') as file:
    return json.load(file)['metrics']['eval/accuracy']


def main(argv):
  del argv
  root = os.path.join(FLAGS.work, 'photos')
  weights = os.path.join(FLAGS.work, f'{FLAGS.model}.safetensors')
  workdir = os.path.join(FLAGS.work, 'app_eval')
  shutil.rmtree(FLAGS.work, ignore_errors=True)
  make_folder(root)
  model, config = train_and_save(root, weights)
  timm_score, timm_count = timm_accuracy(model, config, root)
  app_score = app_accuracy(root, weights, workdir)
  figures = {
      'model': FLAGS.model, 'epochs': FLAGS.epochs, 'train_images': FLAGS.train_images,
      'test_images': FLAGS.test_images, 'timm_examples': timm_count,
      'timm_data_config': {k: str(v) for k, v in config.items()},
      'timm_accuracy': timm_score, 'app_accuracy': app_score,
      'difference_points': round(100 * (app_score - timm_score), 3),
      'app_command': shlex.join(['python', *app_eval_command(root, weights, workdir)[1:]])}
  print(json.dumps(figures, indent=2))
  if FLAGS.out:
    harness.write_json(FLAGS.out, figures)


if __name__ == '__main__':
  app.run(main)

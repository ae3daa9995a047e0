"""The whole fine-tuning job, this app against timm in PyTorch: the same imported weights, the
same generated folder of photo-size JPEGs, the same recipe, each side a whole process.

    python -m benchmarks.fine_tune_race --work=/tmp/race \
        [--models=resnet18,vit_small_patch16_224] [--train_images=480] [--test_images=160] \
        [--epochs=2] [--out=docs/runs/fine_tune_race.json]

The folder (`data_sources.generated.make_kind_folder`, `--kind`, JPEGs of `--photo_sizes` px,
no damaged files) has a train split and a test split drawn by another seed. Both sides start
from one state_dict: timm's model with seeded random weights, saved as safetensors (no
pretrained weights can be downloaded where this runs). For each model:
  app   `main.py --config=configs/finetune.py --config.init_from=<the safetensors>`, trained on
        train and evaluated on test after each epoch, exactly as a user runs it: the weights'
        own preprocessing (a random resized crop to 224 and a flip; eval the shorter side to
        224 / crop_pct and the centre crop), AdamW, warm-up and cosine, label smoothing, the
        EMA, drop-path, the recipe's evaluators and pictures, a checkpoint per epoch;
  timm  this file with `--side=timm`: timm's model loaded from the same file, the same recipe
        read from configs/finetune.py (the app's per-step learning rates, AdamW without decay
        on biases and norms, label smoothing, drop-path, timm's ModelEmaV3 with its warm-up,
        which differs from the app's), torchvision's RandomResizedCrop, flip and normalisation,
        a DataLoader with one worker per core, accuracy on test after each epoch.
Reports each side's wall time (spawn to exit, start-up, data, evaluation and saving
included), the training images/s of each epoch (from the end of its first step: no
compilation), the held-out accuracy after each epoch and the peak RSS (the timm side's
DataLoader workers apart), in one table with the CPU's ISA, and writes `--out`
(`harness.write_json`).
"""

import json
import os
import shlex
import sys

from absl import app
from absl import flags

from benchmarks import harness

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined when run, not at import (tests import the module
  beside other benchmarks, whose flags share names)."""
  flags.DEFINE_string('work', None, 'Where the folder, the weights and the runs go.')
  flags.DEFINE_list('models', ['resnet18', 'vit_small_patch16_224'], 'Backbones in both apps.')
  flags.DEFINE_string('kind', 'shapes', 'The generated task (a kind of generated.KINDS).')
  flags.DEFINE_integer('train_images', 480, 'Training images.')
  flags.DEFINE_integer('test_images', 160, 'Test images.')
  flags.DEFINE_list('photo_sizes', ['320', '640'], 'Least and most height and width, px.')
  flags.DEFINE_integer('epochs', 2, 'Epochs of each run.')
  flags.DEFINE_integer('batch_size', None, "Both sides' batch (default: the recipe's).")
  flags.DEFINE_enum('side', 'race', ['race', 'timm'], 'race: both sides as child processes; '
                    'timm: the timm side of --spec, in this process (what the race runs).')
  flags.DEFINE_string('spec', None, 'With --side=timm: the JSON file of what to run.')
  flags.DEFINE_string('json', None, 'With --side=timm: where its figures go.')
  flags.DEFINE_string('out', None, 'A JSON file for the figures (optional).')
  flags.mark_flags_as_required(['work'])


def make_folder(root: str) -> None:
  """root/train and root/test of generated JPEGs; the test images from another seed."""
  from data_sources import generated  # pylint: disable=g-import-not-at-top
  if os.path.isdir(root):
    return
  sizes = tuple(int(size) for size in FLAGS.photo_sizes)
  for split, seed, count in (('train', 0, FLAGS.train_images), ('test', 1, FLAGS.test_images)):
    generated.make_kind_folder(root, FLAGS.kind, seed=seed, num_images=count, image_sizes=sizes,
                               messy=False, formats=('JPEG',), split=split)


def save_random_timm(model: str, num_classes: int, path: str) -> None:
  """timm's `model` with seeded random weights and a head of `num_classes`, its state_dict saved
  to `path`: the weights both sides import."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  safetensors.torch.save_file(
      timm.create_model(model, pretrained=False, num_classes=num_classes).state_dict(), path)


def app_command(model: str, root: str, weights: str, workdir: str) -> list[str]:
  return [sys.executable, 'main.py', '--config=configs/finetune.py', f'--workdir={workdir}',
          f'--config.dataset={root}', '--config.train_split=train', '--config.eval_split=test',
          f'--config.model={model}', f'--config.init_from={weights}',
          f'--config.num_epochs={FLAGS.epochs}',
          *([f'--config.batch_size={FLAGS.batch_size}'] if FLAGS.batch_size else [])]


def run_app(model: str, root: str, weights: str) -> dict:
  """The app's side: its figures from the run's metrics."""
  workdir = os.path.join(FLAGS.work, 'runs', f'{model}_app')
  command = app_command(model, root, weights, workdir)
  child = harness.run_child(command, log_path=workdir + '.log')
  steps = harness.read_metrics(workdir)
  return {'side': 'app', 'wall_s': round(child.seconds, 1),
          'peak_rss_mb': round(child.peak_rss_mb),
          'images_per_sec': [values['train/examples_per_sec'] for values in steps
                             if 'train/examples_per_sec' in values],
          'accuracy': [values['eval/accuracy'] for values in steps if 'eval/accuracy' in values],
          'command': shlex.join(['python', *command[1:]])}


def timm_spec(model: str, root: str, weights: str) -> dict:
  """What the timm side runs: configs/finetune.py's recipe, with the app's learning rate of
  every step."""
  from benchmarks import timm_training  # pylint: disable=g-import-not-at-top
  from configs import finetune  # pylint: disable=g-import-not-at-top
  recipe = finetune.get_config()
  batch_size = FLAGS.batch_size or recipe.batch_size
  classes = sorted(os.listdir(os.path.join(root, 'train')))
  train_images = sum(len(os.listdir(os.path.join(root, 'train', name))) for name in classes)
  steps_per_epoch = train_images // batch_size
  return {'model': model, 'root': root, 'weights': weights, 'num_classes': len(classes),
          'epochs': FLAGS.epochs, 'batch_size': batch_size,
          'learning_rates': timm_training.recipe_learning_rates(recipe, steps_per_epoch,
                                                                FLAGS.epochs),
          'weight_decay': recipe.optimizer_options.adamw.weight_decay,
          'label_smoothing': recipe.loss_options.cross_entropy.label_smoothing,
          'ema_decay': recipe.ema_decay,
          'drop_path_rate': recipe.model_options.get(model, {}).get('drop_path_rate', 0.0)}


def run_timm(spec: dict) -> dict:
  """The timm side, as a child running this file with --side=timm."""
  path = os.path.join(FLAGS.work, 'runs', f'{spec["model"]}_timm.spec.json')
  with open(path, 'w', encoding='utf-8') as file:
    json.dump(spec, file)
  command = [sys.executable, '-m', 'benchmarks.fine_tune_race', '--side=timm', f'--spec={path}',
             f'--work={FLAGS.work}']
  figures, child = harness.json_child(command)
  return {'side': 'timm', 'wall_s': round(child.seconds, 1),
          'peak_rss_mb': round(child.peak_rss_mb), **figures,
          'command': shlex.join(['python', *command[1:]])}


def timm_side(spec: dict) -> dict:
  """Fine-tunes timm's model as `spec` says, in this process: its figures."""
  import resource  # pylint: disable=g-import-not-at-top
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import timm.data  # pylint: disable=g-import-not-at-top
  from torchvision import transforms  # pylint: disable=g-import-not-at-top
  from benchmarks import timm_training  # pylint: disable=g-import-not-at-top
  model = timm.create_model(spec['model'], pretrained=False, num_classes=spec['num_classes'],
                            drop_path_rate=spec['drop_path_rate'])
  model.load_state_dict(safetensors.torch.load_file(spec['weights']))
  # The weights' preprocessing, as the app takes it from the same pretrained_cfg.
  data = timm.data.resolve_data_config({}, model=model)
  interpolation = transforms.InterpolationMode(data['interpolation'])
  training = transforms.Compose([
      transforms.RandomResizedCrop(data['input_size'][-1], interpolation=interpolation),
      transforms.RandomHorizontalFlip(), transforms.ToTensor(),
      transforms.Normalize(data['mean'], data['std'])])
  evaluation = timm.data.create_transform(**data)
  workers = len(os.sched_getaffinity(0))
  accuracy = []
  _, epochs = timm_training.train(
      model, os.path.join(spec['root'], 'train'), training, epochs=spec['epochs'],
      learning_rate=spec['learning_rates'], weight_decay=spec['weight_decay'],
      label_smoothing=spec['label_smoothing'], batch_size=spec['batch_size'],
      num_workers=workers, ema_decay=spec['ema_decay'],
      after_epoch=lambda evaluated, epoch: accuracy.append(timm_training.accuracy(
          evaluated, os.path.join(spec['root'], 'test'), evaluation, workers)[0]))
  return {'images_per_sec': [epoch['images_per_sec'] for epoch in epochs],
          'accuracy': accuracy, 'dataloader_workers': workers,
          # The largest of the DataLoader workers (processes of their own, not in the RSS).
          'worker_peak_rss_mb': round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                                      / 1024)}


def table(rows: list[dict]) -> str:
  cells = []
  for row in rows:
    app_row = next(other for other in rows
                   if other['model'] == row['model'] and other['side'] == 'app')
    cells.append([
        row['model'], row['side'], f'{row["wall_s"]:.0f}',
        f'{app_row["wall_s"] / row["wall_s"]:.2f}' if row['side'] != 'app' else '1',
        ', '.join(f'{rate:.1f}' for rate in row['images_per_sec']),
        ', '.join(f'{100 * value:.1f}%' for value in row['accuracy']),
        f'{row["peak_rss_mb"] / 1024:.1f}'
        + (f' (+{row["dataloader_workers"]} workers, {row["worker_peak_rss_mb"] / 1024:.1f} '
           'each at most)' if 'dataloader_workers' in row else '')])
  return harness.markdown_table(
      ['model', 'side', 'wall time (s)', 'app time / this', 'training images/s by epoch',
       'held-out accuracy by epoch', 'peak RSS (GB)'], cells, align='llrrrrr')


def main(argv):
  del argv
  if FLAGS.side == 'timm':
    with open(FLAGS.spec, encoding='utf-8') as file:
      figures = timm_side(json.load(file))
    with open(FLAGS.json, 'w', encoding='utf-8') as file:
      json.dump(figures, file)
    return
  os.makedirs(os.path.join(FLAGS.work, 'runs'), exist_ok=True)
  root = os.path.join(FLAGS.work, FLAGS.kind)
  make_folder(root)
  num_classes = len(os.listdir(os.path.join(root, 'train')))
  rows = []
  for model in FLAGS.models:
    weights = os.path.join(FLAGS.work, 'runs', f'{model}.safetensors')
    save_random_timm(model, num_classes, weights)
    spec = timm_spec(model, root, weights)
    for row in (run_app(model, root, weights), run_timm(spec)):
      rows.append({'model': model, **row})
      print(json.dumps(rows[-1]), flush=True)
  print(f'\n{FLAGS.kind}: {FLAGS.train_images} training and {FLAGS.test_images} test JPEGs of '
        f'{FLAGS.photo_sizes[0]}-{FLAGS.photo_sizes[1]} px, {FLAGS.epochs} epochs')
  print(harness.machine_line(harness.machine()))
  print(table(rows))
  if FLAGS.out:
    harness.write_json(FLAGS.out, {
        'kind': FLAGS.kind, 'train_images': FLAGS.train_images,
        'test_images': FLAGS.test_images, 'photo_sizes': FLAGS.photo_sizes,
        'epochs': FLAGS.epochs, 'runs': rows})


if __name__ == '__main__':
  define_flags()
  app.run(main)

"""When fine-tuning pays at photo size: a backbone pretrained on one generated photo task (by
this app, or by timm in PyTorch and imported), then linear probing and full fine-tuning on
another (other classes), against the same recipe from scratch at equal steps.

    python -m benchmarks.fine_tuning --work=/tmp/fine_tuning [--model=resnet18] [--size=64]
        [--pretrain_with=app|timm] [--pretrain_epochs=3] [--pretrain_learning_rate=0.001]
        [--epochs=3] [--out=docs/fine_tuning_runs.json]

Folders (`data_sources.generated.make_kind_folder`, 180-320 px, PNG/JPEG/BMP/GIF, a fifth
grayscale, no damaged files): the source task, digits in random colours (10 classes), and the
target task, shapes in random colours (4 classes), each with a test split of `--test_images`
drawn by another seed of the same generator. Every run is
`main.py --config=configs/finetune.py` with `train_split=train`, `eval_split=test`, the
evaluators loss and accuracy, and one preprocessing for all arms (`--size`: a random resized
crop of 35-100% of the decoded photo's area, so that a digit stays legible, flipped,
ImageNet-normalised or, with `--standardize`, standardised per image; eval the shorter side to
size/0.875 and the centre crop):
  pretrain   the model from scratch on the source task (`--pretrain_epochs`); with
             `--pretrain_with=timm`, timm's model in PyTorch with the same recipe and
             preprocessing (`pretrain_in_timm`), its state_dict saved as safetensors;
  scratch    the target task from scratch (`--epochs`);
  finetune   the same, `--config.init_from=<pretrain workdir or .safetensors>` (the new head
             by its shape);
  probe      the same with `--config.linear_probe=True --config.learning_rate=0.01`: the
             head trained on the backbone's features of the eval crops, computed once;
  probe_views  the same on `--epochs` cached views through the random ops (epoch e's
             augmented images, as the epoch loop sees them; `--config.linear_probe_views`);
  probe_loop  the same without the cache (`--config.linear_probe_cache=False`): the whole
             model at every step, on the augmented images;
  random_probe  a linear probe on the random features of a fresh model (no init_from).
and, without training, the target task's `--feature_evaluators` (`main.py --mode=eval`: kNN and
few-shot accuracy of the pooled features, fitted on the target's training images, scored on its
test images):
  features   of the pretrained model (`--config.init_from`);
  random_features  of timm's model with seeded random weights (saved as safetensors and
             imported the same way).
Prints a table (held-out accuracy after the last epoch, its steps, the run's wall time start-up
included) and writes `--out` (`harness.write_json`: the figures and each arm's command).
`--concurrent`
trains the target arms at once (less time in all on a machine with cores to spare; each arm's
wall time then includes the others'); `--keep_pretrained` reuses a finished pretraining.
"""

import concurrent.futures
import json
import os
import shlex
import shutil
import sys
import time

from absl import app
from absl import flags

from benchmarks import harness
from benchmarks import timm_training
from configs import finetune
from data_sources import generated

FLAGS = flags.FLAGS
flags.DEFINE_string('work', None, 'Where the folders and the runs go.')
flags.DEFINE_string('model', 'resnet18', 'A registered backbone that declares its layers.')
flags.DEFINE_integer('size', 64, 'The model input, cut from the 180-320 px photos (timm: 224; '
                     'the default fits the CPU time of a shared 2-core machine).')
flags.DEFINE_string('source', 'digits', 'The pretraining task (a kind of generated.KINDS).')
flags.DEFINE_string('target', 'shapes', 'The target task (another kind).')
flags.DEFINE_integer('source_images', 400, 'Training images of the source task.')
flags.DEFINE_integer('target_images', 240, 'Training images of the target task.')
flags.DEFINE_integer('test_images', 120, 'Test images of each task.')
flags.DEFINE_integer('pretrain_epochs', 3, 'Epochs of pretraining.')
flags.DEFINE_integer('epochs', 3, 'Epochs of every target run.')
flags.DEFINE_float('pretrain_learning_rate', None, "The pretraining's learning rate (default: "
                   "configs/finetune.py's, a fine-tuning rate; from scratch a higher one learns "
                   'faster).')
flags.DEFINE_bool('standardize', False, 'Standardise each image per channel, the polarity '
                  "by its skewness (`standardize(per_channel=True, polarity=True)`, the small-"
                  "folder recipe's), instead of ImageNet's normalisation: random colours then "
                  'say nothing.')
flags.DEFINE_list('arms', ['scratch', 'finetune', 'probe', 'random_probe'], 'Target runs, '
                  'and the feature scores: features, random_features.')
flags.DEFINE_string('feature_evaluators', 'knn(20)|fewshot(5)', 'What the feature arms score.')
flags.DEFINE_bool('concurrent', False, 'Train the target arms at the same time (their wall '
                  'times then share the machine).')
flags.DEFINE_enum('pretrain_with', 'app', ['app', 'timm'], 'Who pretrains: this app (the '
                  'target arms start from its workdir), or timm in PyTorch with the same recipe '
                  '(they import its state_dict, <work>/runs/pretrain.safetensors).')
flags.DEFINE_bool('keep_pretrained', False, 'Reuse <work>/runs/pretrain if it finished.')
flags.DEFINE_string('out', None, 'A JSON file for the figures (optional).')
flags.mark_flags_as_required(['work'])
PHOTO_SIZES = (180, 320)
STANDARDIZE = 'standardize(per_channel=True, polarity=True)'
# The target arms: their flags on top of the common ones ({pretrained}: the pretrain workdir).
ARMS = {'scratch': [],
        'finetune': ['--config.init_from={pretrained}'],
        'probe': ['--config.init_from={pretrained}', '--config.linear_probe=True',
                  '--config.learning_rate=0.01'],
        'probe_views': ['--config.init_from={pretrained}', '--config.linear_probe=True',
                        '--config.learning_rate=0.01', '--config.linear_probe_views={epochs}'],
        'probe_loop': ['--config.init_from={pretrained}', '--config.linear_probe=True',
                       '--config.learning_rate=0.01', '--config.linear_probe_cache=False'],
        'random_probe': ['--config.linear_probe=True', '--config.learning_rate=0.01']}


def make_task(root: str, kind: str, seed: int, train_images: int, test_images: int) -> None:
  """root/train and root/test of generated photos; the test images from another seed."""
  if os.path.isdir(root):
    return
  generated.make_kind_folder(root, kind, seed=seed, num_images=train_images,
                             image_sizes=PHOTO_SIZES, messy=False)
  generated.make_kind_folder(root, kind, seed=seed + 100, num_images=test_images,
                             image_sizes=PHOTO_SIZES, messy=False, split='test')


def command(root: str, workdir: str, epochs: int, extra: list[str]) -> list[str]:
  """The main.py run of configs/finetune.py on `root` with the common overrides."""
  return [sys.executable, 'main.py',
          '--config=configs/finetune.py', f'--workdir={workdir}',
          f'--config.dataset={root}', '--config.train_split=train', '--config.eval_split=test',
          f'--config.model={FLAGS.model}', f'--config.num_epochs={epochs}',
          f'--config.preprocess=random_resized_crop({FLAGS.size}, scale=(0.35, 1.0))|flip_lr|'
          + (STANDARDIZE if FLAGS.standardize else 'normalize("imagenet")'),
          '--config.evaluators=loss|accuracy', *extra]


def torch_transforms():
  """The benchmark's preprocessing in torchvision: (training, eval) transforms. The
  standardisation is the app's own op, applied to each image's NumPy array."""
  import torch  # pylint: disable=g-import-not-at-top  (optional extras)
  from torchvision import transforms  # pylint: disable=g-import-not-at-top
  # After torch: importing TensorFlow first makes timm's import of triton crash.
  import preprocessing  # pylint: disable=g-import-not-at-top
  size = FLAGS.size
  if FLAGS.standardize:
    op = preprocessing.parse(STANDARDIZE).scale
    normalize = [transforms.ToTensor(), transforms.Lambda(
        lambda image: torch.from_numpy(op(image.permute(1, 2, 0).numpy())).permute(2, 0, 1))]
  else:
    normalize = [transforms.ToTensor(),
                 transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
  return (transforms.Compose([transforms.RandomResizedCrop(size, scale=(0.35, 1.0)),
                              transforms.RandomHorizontalFlip(), *normalize]),
          transforms.Compose([transforms.Resize(int(size / 0.875)),
                              transforms.CenterCrop(size), *normalize]))


def pretrain_in_timm(root: str, weights: str) -> dict:
  """Pretrains timm's model from scratch on root/train with configs/finetune.py's recipe, read
  from it (AdamW and its weight decay, the warm-up and cosine schedule, label smoothing,
  drop-path, the batch size; not the EMA), saves its state_dict to `weights`, scores
  root/test."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  recipe = finetune.get_config()
  started = time.time()
  torch.manual_seed(0)
  train_images = timm_training.image_folder(os.path.join(root, 'train'), None)
  model_options = recipe.model_options.get(FLAGS.model, {})
  model = timm.create_model(FLAGS.model, pretrained=False,
                            num_classes=len(train_images.classes),
                            drop_path_rate=model_options.get('drop_path_rate', 0.0))
  training, evaluation = torch_transforms()
  steps_per_epoch = len(train_images) // recipe.batch_size
  rates = timm_training.recipe_learning_rates(recipe, steps_per_epoch, FLAGS.pretrain_epochs,
                                              FLAGS.pretrain_learning_rate)
  timm_training.train(
      model, os.path.join(root, 'train'), training, epochs=FLAGS.pretrain_epochs,
      learning_rate=rates, weight_decay=recipe.optimizer_options.adamw.weight_decay,
      label_smoothing=recipe.loss_options.cross_entropy.label_smoothing,
      batch_size=recipe.batch_size, num_workers=0)
  safetensors.torch.save_file(model.state_dict(), weights)
  score, _ = timm_training.accuracy(model, os.path.join(root, 'test'), evaluation)
  figures = {'arm': 'pretrain', 'accuracy': score, 'steps': FLAGS.pretrain_epochs *
             steps_per_epoch, 'epochs': FLAGS.pretrain_epochs,
             'wall_s': round(time.time() - started, 1),
             'command': f'timm {FLAGS.model} in PyTorch (benchmarks/fine_tuning.py '
                        'pretrain_in_timm)'}
  print(json.dumps(figures), flush=True)
  return figures


def train_arm(name: str, root: str, epochs: int, extra: list[str]) -> dict:
  """Trains one arm in <work>/runs/<name> (a fresh workdir, its output in <name>.log): its
  figures and command (also in <workdir>.json)."""
  workdir = os.path.join(FLAGS.work, 'runs', name)
  shutil.rmtree(workdir, ignore_errors=True)
  args = command(root, workdir, epochs, extra)
  child = harness.run_child(args, log_path=workdir + '.log')
  last_eval = [values for values in harness.read_metrics(workdir) if 'eval/accuracy' in values][-1]
  figures = {'arm': name, 'accuracy': last_eval['eval/accuracy'], 'steps': last_eval['step'],
             'epochs': epochs, 'wall_s': round(child.seconds, 1),
             'command': shlex.join(['python', *args[1:]])}
  with open(workdir + '.json', 'w', encoding='utf-8') as file:
    json.dump(figures, file)
  print(json.dumps(figures), flush=True)
  return figures


def save_random_timm(weights: str) -> str:
  """timm's model with seeded random weights, its state_dict saved to `weights`."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top  (optional extras)
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  safetensors.torch.save_file(timm.create_model(FLAGS.model, pretrained=False).state_dict(),
                              weights)
  return weights


def score_features(name: str, root: str, weights: str) -> dict:
  """The feature evaluators of `weights` on root's test images, fitted on root/train, without
  training (`main.py --mode=eval` of a workdir with only init_from): their figures and command."""
  workdir = os.path.join(FLAGS.work, 'runs', name)
  shutil.rmtree(workdir, ignore_errors=True)
  args = [*command(root, workdir, 1, [f'--config.init_from={weights}']), '--mode=eval',
          # accuracy (of the untrained head, not reported) for config.best_metric's sake.
          f'--config.evaluators=accuracy|{FLAGS.feature_evaluators}']
  child = harness.run_child(args, log_path=workdir + '.log')
  with open(os.path.join(workdir, 'eval_test_0.json'), encoding='utf-8') as file:
    report = json.load(file)
  # Imports TensorFlow: after every use of timm (timm's import of triton crashes after it).
  import evaluators  # pylint: disable=g-import-not-at-top
  scored = evaluators.directions(evaluators.create(FLAGS.feature_evaluators))
  figures = {'arm': name, **{metric: report['metrics'][f'eval/{metric}'] for metric in scored},
             'wall_s': round(child.seconds, 1), 'command': shlex.join(['python', *args[1:]])}
  print(json.dumps(figures), flush=True)
  return figures


def main(argv):
  del argv
  os.makedirs(os.path.join(FLAGS.work, 'runs'), exist_ok=True)
  source = os.path.join(FLAGS.work, FLAGS.source)
  target = os.path.join(FLAGS.work, FLAGS.target)
  make_task(source, FLAGS.source, 0, FLAGS.source_images, FLAGS.test_images)
  make_task(target, FLAGS.target, 1, FLAGS.target_images, FLAGS.test_images)
  pretrain_run = os.path.join(FLAGS.work, 'runs', 'pretrain')
  pretrained = (pretrain_run if FLAGS.pretrain_with == 'app'
                else pretrain_run + '.safetensors')
  random_weights = (save_random_timm(os.path.join(FLAGS.work, 'runs', 'random.safetensors'))
                    if 'random_features' in FLAGS.arms else None)  # timm before TensorFlow.
  rows = []
  trained_arms = [arm for arm in FLAGS.arms if arm in ARMS]
  if not ('features' in FLAGS.arms or any('{pretrained}' in flag for arm in trained_arms
                                           for flag in ARMS[arm])):
    pass  # No arm starts from the pretrained model.
  elif FLAGS.keep_pretrained and os.path.exists(pretrain_run + '.json'):
    with open(pretrain_run + '.json', encoding='utf-8') as file:
      rows = [json.load(file)]
  elif FLAGS.pretrain_with == 'timm':
    rows = [pretrain_in_timm(source, pretrained)]
    with open(pretrain_run + '.json', 'w', encoding='utf-8') as file:
      json.dump(rows[0], file)
  else:
    rate = FLAGS.pretrain_learning_rate
    rows = [train_arm('pretrain', source, FLAGS.pretrain_epochs,
                      [] if rate is None else [f'--config.learning_rate={rate}'])]
  train_target = lambda arm: train_arm(arm, target, FLAGS.epochs,
                                       [flag.format(pretrained=pretrained, epochs=FLAGS.epochs)
                                        for flag in ARMS[arm]])
  with concurrent.futures.ThreadPoolExecutor(max(len(FLAGS.arms), 1) if FLAGS.concurrent
                                             else 1) as pool:
    rows += list(pool.map(train_target, trained_arms))
  if 'features' in FLAGS.arms:
    rows.append(score_features('features', target, pretrained))
  if 'random_features' in FLAGS.arms:
    rows.append(score_features('random_features', target, random_weights))
  print(f'\n{FLAGS.model} at {FLAGS.size} px; source {FLAGS.source} ({FLAGS.source_images} '
        f'images), target {FLAGS.target} ({FLAGS.target_images}); {FLAGS.test_images} test '
        'images each')
  print(harness.markdown_table(
      ['run', 'task', 'held-out accuracy', 'steps', 'wall time (s)'],
      [[row['arm'], FLAGS.source if row['arm'] == 'pretrain' else FLAGS.target,
        ', '.join(f'{name} {100 * value:.2f}%' for name, value in row.items()
                  if name == 'accuracy' or name.endswith('_accuracy')),
        row.get('steps', 0), f'{row["wall_s"]:.0f}'] for row in rows],
      align='llrrr'))
  if FLAGS.out:
    harness.write_json(FLAGS.out, {
        'model': FLAGS.model, 'size': FLAGS.size, 'pretrain_with': FLAGS.pretrain_with,
        'source': FLAGS.source, 'target': FLAGS.target, 'source_images': FLAGS.source_images,
        'target_images': FLAGS.target_images, 'test_images': FLAGS.test_images, 'runs': rows})


if __name__ == '__main__':
  app.run(main)

"""Training and scoring a timm model in PyTorch on an image folder, for the benchmarks that set
the app beside timm (timm_parity, fine_tuning, fine_tune_race). Needs the extras timm,
torchvision and safetensors.

The loop is the plain one of timm's docs (AdamW, a DataLoader, cross-entropy) with the options
the app's recipes use: a learning rate per step (the app's schedule, given), label smoothing,
and no weight decay on biases and normalisation scales (timm's `param_groups_weight_decay`, as
the app's AdamW decays kernels alone).
"""

import time
from collections.abc import Callable, Sequence

# pylint: disable=g-import-not-at-top  (optional extras, imported where they are used)


def image_folder(root: str, transform):
  """torchvision's ImageFolder of every file (its default extensions leave GIFs out)."""
  import torchvision
  return torchvision.datasets.ImageFolder(root, transform, is_valid_file=lambda path: True)


def recipe_learning_rates(recipe, steps_per_epoch: int, epochs: int,
                          learning_rate: float | None = None) -> list[float]:
  """The learning rate of each step (0-based) of a run of the app's config `recipe` (its
  schedule and warm-up; `learning_rate` instead of its rate if given), from the app's own
  schedule: the warm-up from 0, then e.g. the cosine down to 0. Imports JAX (optax)."""
  from training import optimizers
  schedule = optimizers.Optimization(
      optimizer=None, schedule=optimizers.SCHEDULES.entry(recipe.schedule).factory,
      learning_rate=learning_rate or recipe.learning_rate, warmup_epochs=recipe.warmup_epochs,
      num_epochs=epochs).learning_rate_schedule(steps_per_epoch)
  return [float(schedule(step)) for step in range(steps_per_epoch * epochs)]


def train(model, root: str, transform, *, epochs: int,
          learning_rate: Callable[[int], float] | Sequence[float],
          weight_decay: float = 0.05, label_smoothing: float = 0.0, batch_size: int = 32,
          seed: int = 0, num_workers: int = 2, ema_decay: float = 0.0,
          after_epoch: Callable[[object, int], None] | None = None) -> tuple[object, list[dict]]:
  """Trains `model` in place on the folder `root` (`root/<class>/<image>`), the last partial
  batch of each epoch dropped as the app drops it, at `learning_rate(step)` (0-based), or
  `learning_rate[step]` for the rates of each step (`recipe_learning_rates`). `num_workers`:
  the DataLoader's processes (0 where JAX runs in this process: they would be forked from its
  threads). With `ema_decay`, timm's ModelEmaV3 (its
  warm-up on) averages the weights, and the average is the model evaluated.

  Prints each epoch's mean loss, training accuracy and time, then calls `after_epoch(model to
  evaluate, epoch)` (1-based). Returns the model to evaluate, in eval mode, and each epoch's
  figures: its loss, training accuracy, seconds and training images/s, counted as the app's
  TrainMetrics counts them, from the end of the epoch's first step (so that both sides leave
  out the same start-up: the app's compilation, the DataLoader's first workers).
  """
  import timm.optim
  import timm.utils
  import torch
  torch.manual_seed(seed)
  images = image_folder(root, transform)
  loader = torch.utils.data.DataLoader(images, batch_size=batch_size, shuffle=True,
                                       num_workers=num_workers, drop_last=True)
  # A base rate of 1 scaled by the schedule: the schedule's values are the rates.
  optimizer = torch.optim.AdamW(timm.optim.param_groups_weight_decay(model, weight_decay), lr=1)
  if not callable(rates := learning_rate):  # LambdaLR also asks for the step after the last.
    learning_rate = lambda step: rates[min(step, len(rates) - 1)]
  schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                               lambda step: float(learning_rate(step)))
  ema = timm.utils.ModelEmaV3(model, decay=ema_decay, use_warmup=True) if ema_decay else None
  evaluated = model if ema is None else ema.module
  figures = []
  for epoch in range(epochs):
    model.train()
    started, loss_sum, correct, seen, steps = time.time(), 0.0, 0, 0, 0
    for inputs, labels in loader:
      logits = model(inputs)
      loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=label_smoothing)
      optimizer.zero_grad()
      loss.backward()
      optimizer.step()
      schedule.step()
      if ema is not None:
        ema.update(model, step=epoch * len(loader) + steps)
      loss_sum += loss.item() * len(labels)
      correct += int((logits.argmax(dim=1) == labels).sum())
      seen += len(labels)
      steps += 1
      if steps == 1:
        first_step_done = time.time()
    ended = time.time()
    figures.append({'epoch': epoch + 1, 'loss': loss_sum / seen, 'train_accuracy': correct / seen,
                    'seconds': ended - started,
                    'images_per_sec': (steps - 1) * batch_size / max(ended - first_step_done,
                                                                     1e-9)})
    print(f'timm epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.4f}, training accuracy '
          f'{correct / seen:.4f} ({ended - started:.0f} s)', flush=True)
    if after_epoch is not None:
      after_epoch(evaluated.eval(), epoch + 1)
  return evaluated.eval(), figures


def accuracy(model, root: str, transform, num_workers: int = 0) -> tuple[float, int]:
  """The accuracy of `model` on the folder `root` and its number of images."""
  import torch
  images = image_folder(root, transform)
  correct = 0
  with torch.no_grad():
    for inputs, labels in torch.utils.data.DataLoader(images, batch_size=64,
                                                      num_workers=num_workers):
      correct += int((model(inputs).argmax(dim=1) == labels).sum())
  return correct / len(images), len(images)

"""Training and scoring a timm model in PyTorch on an image folder, for the benchmarks that set
the app beside timm (timm_parity, fine_tuning). Needs the extras timm, torchvision and
safetensors.

The loop is the plain one of timm's docs (AdamW, a DataLoader, cross-entropy) with the options
the app's recipes use: a learning rate per step (the app's schedule, given), label smoothing,
and no weight decay on biases and normalisation scales (timm's `param_groups_weight_decay`, as
the app's AdamW decays kernels alone).
"""

import time
from typing import Callable

# pylint: disable=g-import-not-at-top  (optional extras, imported where they are used)


def image_folder(root: str, transform):
  """torchvision's ImageFolder of every file (its default extensions leave GIFs out)."""
  import torchvision
  return torchvision.datasets.ImageFolder(root, transform, is_valid_file=lambda path: True)


def train(model, root: str, transform, *, epochs: int, learning_rate: Callable[[int], float],
          weight_decay: float = 0.05, label_smoothing: float = 0.0, batch_size: int = 32,
          seed: int = 0, num_workers: int = 2):
  """Trains `model` in place on the folder `root` (`root/<class>/<image>`), the last partial
  batch of each epoch dropped as the app drops it, at `learning_rate(step)` (0-based; e.g. the
  app's own schedule); returns it in eval mode. Prints each epoch's mean loss, training
  accuracy and time. `num_workers`: the DataLoader's processes (0 where JAX runs in this
  process: they would be forked from its threads)."""
  import timm.optim
  import torch
  torch.manual_seed(seed)
  images = image_folder(root, transform)
  loader = torch.utils.data.DataLoader(images, batch_size=batch_size, shuffle=True,
                                       num_workers=num_workers, drop_last=True)
  # A base rate of 1 scaled by the schedule: the schedule's values are the rates.
  optimizer = torch.optim.AdamW(timm.optim.param_groups_weight_decay(model, weight_decay), lr=1)
  schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                               lambda step: float(learning_rate(step)))
  model.train()
  for epoch in range(epochs):
    started, loss_sum, correct, seen = time.time(), 0.0, 0, 0
    for inputs, labels in loader:
      logits = model(inputs)
      loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=label_smoothing)
      optimizer.zero_grad()
      loss.backward()
      optimizer.step()
      schedule.step()
      loss_sum += loss.item() * len(labels)
      correct += int((logits.argmax(dim=1) == labels).sum())
      seen += len(labels)
    print(f'timm epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.4f}, training accuracy '
          f'{correct / seen:.4f} ({time.time() - started:.0f} s)', flush=True)
  return model.eval()


def accuracy(model, root: str, transform) -> tuple[float, int]:
  """The accuracy of `model` on the folder `root` and its number of images."""
  import torch
  images = image_folder(root, transform)
  correct = 0
  with torch.no_grad():
    for inputs, labels in torch.utils.data.DataLoader(images, batch_size=64):
      correct += int((model(inputs).argmax(dim=1) == labels).sum())
  return correct / len(images), len(images)

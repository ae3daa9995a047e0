"""The PyTorch peer: this project's MNIST training written as a PyTorch user would write it.

    python -m benchmarks.pytorch_mnist --variant=eager --epochs=2 \
      --mnist_dir=$TFDS_DATA_DIR/downloads/manual --json=/tmp/eager.json

`benchmarks/peer.py` runs it beside this project's `main.py`. The model is `models.CNN` layer for
layer and in its order, with PyTorch's default initialisations; SGD lr 0.1 momentum 0.9 as
configs/default.py (`torch.optim.SGD`'s momentum buffer `b = 0.9 b + g`, step `-0.1 b`, is
optax.sgd's trace); batches of 128, reshuffled every epoch, the last partial batch dropped. The
four original MNIST files are read with gzip and numpy, and both splits are held in memory on
--device as float32 tensors in [0, 1], NCHW. After each epoch, all 10,000 test images are
evaluated in eval mode. TensorFlow is never imported, so the process starts as PyTorch's own.

--variant:
  eager          float32, eager.
  autocast_bf16  forward pass and loss under `torch.autocast` to bfloat16 (eval too).
  compile        `torch.compile(model)`, default mode (its compile time falls in epoch 1).
  channels_last  the model and the batches in the channels-last memory format.

Threads: PyTorch's defaults, untouched (what a user gets: intra-op threads = physical cores).

Writes to --json, per epoch: training examples/s (training steps only, timed between device
syncs), eval accuracy, seconds since this process's first statement; and the variant, device,
thread counts and versions.
"""

import time

_START = time.perf_counter()  # First statement: the process's own times count from here.

# pylint: disable=g-import-not-at-top,g-bad-import-order  (after the start time, on purpose)
import contextlib
import functools
import gzip
import json
import os

from absl import app
from absl import flags
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
# pylint: enable=g-import-not-at-top,g-bad-import-order

VARIANTS = ('eager', 'autocast_bf16', 'compile', 'channels_last')
# The original files, as in a TFDS manual dir (README.md).
TRAIN_FILES = ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz')
TEST_FILES = ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz')
BATCH_SIZE = 128
EVAL_BATCH_SIZE = 1000  # As configs/default.py's eval_batch_size.


class CNN(nn.Module):
  """`models.CNN` in PyTorch, layer for layer and in its order."""

  def __init__(self, image_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
               dropout_rate: float = 0.025):
    super().__init__()
    height, width, channels = image_shape
    self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, padding='same')
    self.dropout1 = nn.Dropout(dropout_rate)
    # flax's BatchNorm momentum 0.99 keeps 0.99 of the running statistics per step; torch's
    # momentum is the share of the new batch's, 0.01. eps 1e-5 in both.
    self.batch_norm1 = nn.BatchNorm2d(32, eps=1e-5, momentum=0.01)
    self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding='same')
    self.batch_norm2 = nn.BatchNorm2d(64, eps=1e-5, momentum=0.01)
    self.linear1 = nn.Linear(height // 2 // 2 * (width // 2 // 2) * 64, 256)
    self.dropout2 = nn.Dropout(dropout_rate)
    self.linear2 = nn.Linear(256, num_classes)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = F.avg_pool2d(F.relu(self.batch_norm1(self.dropout1(self.conv1(x)))), 2)
    x = F.avg_pool2d(F.relu(self.batch_norm2(self.conv2(x))), 2)
    x = torch.flatten(x, 1)
    x = F.relu(self.dropout2(self.linear1(x)))
    return self.linear2(x)


def read_idx(path: str) -> np.ndarray:
  """The uint8 array in a gzipped idx file (MNIST's format: images (N, H, W), labels (N,))."""
  with gzip.open(path, 'rb') as f:
    data = f.read()
  if data[:3] != b'\x00\x00\x08':
    raise ValueError(f'{path} is not an idx file of unsigned bytes.')
  num_dims = data[3]
  shape = np.frombuffer(data, '>i4', count=num_dims, offset=4)
  return np.frombuffer(data, np.uint8, offset=4 + 4 * num_dims).reshape(shape)


def load_split(mnist_dir: str, files: tuple[str, str], device: torch.device,
               memory_format: torch.memory_format,
               num_examples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
  """(images, labels) of one split on `device`: float32 in [0, 1] NCHW, and int64.

  The first `num_examples` examples (default: all).
  """
  images, labels = (read_idx(os.path.join(mnist_dir, name))[:num_examples] for name in files)
  images = images[..., None].astype(np.float32) / 255  # NHWC, as this project holds them.
  images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(memory_format=memory_format)
  return images.to(device), torch.from_numpy(labels.astype(np.int64)).to(device)


def synchronize(device: torch.device) -> None:
  """Waits until `device` has done all work queued so far (CPU work is done when it returns)."""
  if device.type == 'cuda':
    torch.cuda.synchronize(device)


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             autocast: contextlib.AbstractContextManager) -> float:
  """Accuracy of `model` (whose train/eval mode the caller sets) on all of `images`."""
  correct = torch.zeros((), dtype=torch.int64, device=labels.device)
  with torch.no_grad(), autocast:
    for start in range(0, len(labels), EVAL_BATCH_SIZE):
      logits = model(images[start:start + EVAL_BATCH_SIZE])
      correct += (logits.argmax(dim=1) == labels[start:start + EVAL_BATCH_SIZE]).sum()
  return correct.item() / len(labels)


def train_and_evaluate(variant: str, epochs: int, mnist_dir: str, device: str = 'cpu',
                       train_examples: int | None = None, seed: int = 0,
                       eval_examples: int | None = None) -> dict:
  """Trains the CNN as `variant` for `epochs` epochs; returns the figures of every epoch."""
  torch.manual_seed(seed)
  device = torch.device(device)
  memory_format = torch.channels_last if variant == 'channels_last' else torch.contiguous_format
  train_images, train_labels = load_split(mnist_dir, TRAIN_FILES, device, memory_format,
                                          train_examples)
  test_images, test_labels = load_split(mnist_dir, TEST_FILES, device, memory_format,
                                        eval_examples)
  model = CNN().to(device, memory_format=memory_format)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  forward = torch.compile(model) if variant == 'compile' else model
  # A fresh context per use: torch.autocast is entered once per `with`.
  autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                               enabled=variant == 'autocast_bf16')

  def train_step(images: torch.Tensor, labels: torch.Tensor) -> None:
    with autocast():
      loss = F.cross_entropy(forward(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

  steps = len(train_labels) // BATCH_SIZE
  figures = []
  for epoch in range(1, epochs + 1):
    model.train()
    order = torch.randperm(len(train_labels), device=device)
    synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
      batch = order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE]
      train_step(train_images[batch].contiguous(memory_format=memory_format), train_labels[batch])
    synchronize(device)
    train_seconds = time.perf_counter() - start
    model.eval()
    accuracy = evaluate(forward, test_images, test_labels, autocast())
    figures.append({'epoch': epoch, 'train_examples_per_sec': steps * BATCH_SIZE / train_seconds,
                    'train_seconds': train_seconds, 'eval_accuracy': accuracy,
                    'seconds_from_start': time.perf_counter() - _START})
    print(f'epoch {epoch}/{epochs}: {figures[-1]["train_examples_per_sec"]:.0f} training '
          f'examples/s, eval_accuracy {accuracy:.4f}', flush=True)
  return {'variant': variant, 'device': str(device),
          'device_name': (torch.cuda.get_device_name(device) if device.type == 'cuda'
                          else 'cpu'),
          'train_examples': steps * BATCH_SIZE, 'num_threads': torch.get_num_threads(),
          'num_interop_threads': torch.get_num_interop_threads(),
          'torch_version': torch.__version__, 'epochs': figures}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  figures = train_and_evaluate(FLAGS.variant, FLAGS.epochs, FLAGS.mnist_dir, FLAGS.device,
                               FLAGS.train_examples, eval_examples=FLAGS.eval_examples)
  figures['seconds_from_start'] = time.perf_counter() - _START
  with open(FLAGS.json, 'w') as f:
    json.dump(figures, f, indent=2)


if __name__ == '__main__':
  # Defined here rather than at import, so that benchmarks.peer and the tests can import the
  # model without these flags clashing with their own.
  flags.DEFINE_enum('variant', 'eager', VARIANTS, 'What PyTorch runs (see the module docstring).')
  flags.DEFINE_integer('epochs', 2, 'Epochs to train.', lower_bound=1)
  flags.DEFINE_string('mnist_dir', None, 'Directory holding the four original MNIST .gz files.')
  flags.DEFINE_enum('device', 'cpu', ['cpu', 'cuda'], 'Where to train.')
  flags.DEFINE_integer('train_examples', None,
                       'Train on the first N training images (default: all 60,000).',
                       lower_bound=BATCH_SIZE)
  flags.DEFINE_integer('eval_examples', None,
                       'Evaluate on the first N test images (default: all 10,000).',
                       lower_bound=1)
  flags.DEFINE_string('json', None, 'Where to write the figures.')
  flags.mark_flags_as_required(['mnist_dir', 'json'])
  app.run(main)

"""The classic "PyTorch loads, JAX computes" input pipeline: a torch DataLoader of NumPy batches.

`input_pipeline.train_batches` for `config.input_backend='torch'`, with the tf.data path's
output, so the same train step consumes it: chunks {'image': (K, B, H, W, C) float32 in
[0, 1], 'label': (K, B) int32} with K = `config.steps_per_dispatch`, the incomplete final batch
of an epoch dropped, and every epoch shuffled (fully, whatever `config.shuffle_buffer_size`)
from its own seed, so that a run can restart at any epoch and see the same data.
"""

from collections.abc import Iterator
import itertools

import jax
import ml_collections
import numpy as np
import torch
from torch.utils import data as torch_data

from data_sources import base
import input_pipeline


class _Examples(torch_data.Dataset):
  """A `Split` as a map-style dataset of (normalised image, label) NumPy examples."""

  def __init__(self, split: base.Split):
    self.split = split

  def __len__(self) -> int:
    return len(self.split.labels)

  def __getitem__(self, index: int) -> input_pipeline.Batch:
    # The same float32 division as input_pipeline's tf.data map: identical pixel values.
    return {'image': self.split.images[index].astype(np.float32) / 255.0,
            'label': self.split.labels[index]}


def numpy_collate(batch: list[input_pipeline.Batch]) -> input_pipeline.Batch:
  """Stacks examples with torch's default collate, then hands JAX NumPy arrays, not tensors."""
  return jax.tree.map(np.asarray, torch_data.default_collate(batch))


def dataloader_batches(split: base.Split, config: ml_collections.ConfigDict, start_epoch: int,
                       start_step: int) -> Iterator[input_pipeline.Batch]:
  """Yields chunks of training batches from batch `start_step` of `start_epoch` to the end."""
  examples = _Examples(split)
  for epoch in range(start_epoch, config.num_epochs):
    generator = torch.Generator().manual_seed(input_pipeline.epoch_seed(config.seed, epoch))
    batches = iter(torch_data.DataLoader(examples, batch_size=config.batch_size, shuffle=True,
                                         drop_last=True, generator=generator,
                                         collate_fn=numpy_collate))
    if epoch == start_epoch:  # Skips the batches already trained on, keeping the same order.
      batches = itertools.islice(batches, start_step, None)
    while chunk := list(itertools.islice(batches, config.steps_per_dispatch)):
      yield jax.tree.map(lambda *steps: np.stack(steps), *chunk)

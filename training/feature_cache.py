"""A linear probe's training data: the frozen backbone's pooled features of each training image,
computed once, instead of the backbone run on every image at every step of every epoch.

With config.linear_probe every parameter but the head's is frozen and every BatchNorm keeps its
statistics, so the backbone gives the same features of the same image at every step. `compute`
takes them once per view: each image as eval prepares it (`views=0`), or through the random ops
as the first `views` epochs draw them. `batches` shuffles a view anew each epoch, from the
epoch's seed, and the train step of features (`state.make_train_step(..., features=True)`)
trains the head on them (`model.logits`). Evaluations still run the whole model on their
images: what they score is what predict and export compute.
"""

from collections.abc import Iterator
import itertools
import time

from absl import logging
from flax import nnx
import numpy as np

from core import progress
import input_pipeline
from training import parallel
from training import state as state_lib

PROGRESS_SECONDS = 10.0  # A progress line at most this often while the features are computed.
View = tuple[np.ndarray, np.ndarray]  # (features (examples, D) float32, labels (examples,)).


def compute(model: nnx.Module, split: input_pipeline.OpenedSplit, data: input_pipeline.Data,
            inputs: input_pipeline.Input, batch_size: int, steps_per_epoch: int, views: int,
            num_epochs: int, place) -> list[View]:
  """The features of this process's training examples, `steps_per_epoch` batches of
  `batch_size` per view: epoch v's images through the random ops for each view v < `views`
  (at most `num_epochs`: no epoch trains on the others), or with `views` 0 one view of the
  images as eval prepares them. `place` puts a batch on the devices."""
  augment = views > 0
  num_views = min(views, num_epochs) if augment else 1
  total = num_views * steps_per_epoch
  rate, last_line = progress.Rate(0, total), time.time()
  logging.info('Linear probe: computing the frozen features of %d training examples%s, once.',
               steps_per_epoch * batch_size,
               f' in {num_views} augmented views' if augment else ' (as eval prepares them)')
  cached = []
  with state_lib.eval_mode(model):
    for view in range(num_views):
      features, labels = [], []
      for batch in itertools.islice(input_pipeline.train_batches(
          split, data, inputs, batch_size, view, 0, augment=augment), steps_per_epoch):
        features.append(parallel.to_process_local(
            state_lib.features_of(model, inputs.preprocess, place(batch)['image'])))
        labels.append(batch['label'])
        done = view * steps_per_epoch + len(labels)
        if (measured := rate.update(done)) and time.time() - last_line >= PROGRESS_SECONDS:
          last_line = time.time()
          logging.info('Linear probe features: batch %d/%d (%.0f%%), %.1f examples/s, ETA %s',
                       done, total, 100 * done / total, measured[0] * batch_size,
                       progress.duration(measured[1]))
      cached.append((np.concatenate(features), np.concatenate(labels)))
  logging.info('Linear probe: %d views of %s features cached (%.1f MB); the head trains on them.',
               len(cached), cached[0][0].shape, sum(view[0].nbytes for view in cached) / 1e6)
  return cached


def batches(views: list[View], seed: int, batch_size: int, start_epoch: int, start_step: int,
            num_epochs: int) -> Iterator[dict[str, np.ndarray]]:
  """Training batches {'features', 'label'} of `batch_size` from batch `start_step` of
  `start_epoch` to the end of the run: epoch e draws view e mod len(views) in the order of its
  own seed (`input_pipeline.epoch_seed`), so a resumed run trains on the same batches."""
  for epoch in range(start_epoch, num_epochs):
    features, labels = views[epoch % len(views)]
    rng = np.random.default_rng(input_pipeline.epoch_seed(seed, epoch) % 2**63)  # Not negative.
    order = rng.permutation(len(labels))
    for step in range(start_step if epoch == start_epoch else 0, len(labels) // batch_size):
      chosen = order[step * batch_size:(step + 1) * batch_size]
      yield {'features': features[chosen], 'label': labels[chosen]}

"""Embed mode: the pooled features of image files, as the classifier takes them.

    python main.py --workdir=runs/photos --mode=embed --inputs=PATH [--checkpoint=best]

PATH is what `--mode=predict` takes, and each image is read and preprocessed as predict reads
it (the eval resize and crop). `<workdir>/embeddings.npy` gets one float32 row per image: the
backbone's pooled features before the classifier (timm's `forward_head(forward_features(x),
pre_logits=True)`), the EMA weights' when the run averaged them; `<workdir>/embeddings.csv`
names the image of each row, in the same order. A workdir of imported weights alone
(`--config.init_from=...`, never trained) embeds with those weights. Only the backbones have
pooled features; the small reference models (cnn, mlp) are refused.
"""

import csv
import os

from absl import logging
import numpy as np

from core import cli
from core import errors
import models
import modes
from modes import predict
from training import run_spec
from training import state

EMBEDDINGS_FILE = 'embeddings.npy'
FILES_FILE = 'embeddings.csv'


def embed(run: run_spec.Run, workdir: str, inputs: str | None,
          checkpoint: str = 'latest') -> str:
  """Writes the pooled features of each image under `inputs` to <workdir>/embeddings.npy and
  their files to <workdir>/embeddings.csv; returns the .npy's path."""
  cli.check_inputs(inputs, 'embed')
  if not hasattr(models.MODELS.entry(run.model.name).factory, 'pre_logits'):
    raise errors.ConfigError(
        f'--mode=embed: model {run.model.name!r} has no pooled features before its classifier: '
        'embed with a backbone (resnet18, vit_small_patch16_224, ...).', key='model',
        value=run.model.name)
  info = modes.dataset_info(run, workdir)
  model, step = modes.load_model(run, workdir, info, checkpoint)  # No checkpoint: said first.
  images = predict.read_images(run, info, inputs)
  logging.info('Embedding %d images with the checkpoint at step %d.', len(images.files), step)
  paths, embeddings = predict.compute(
      images, lambda batch: state.features_of(model, run.input.preprocess, batch), 'embedded')
  if not paths:  # Every file passed the header check but failed to decode.
    raise errors.FlagError(f'No image under --inputs={inputs!r} decodes: pass readable images.',
                           flag='inputs', value=inputs)
  os.makedirs(workdir, exist_ok=True)  # A workdir of init_from's weights, never trained in.
  path = os.path.join(workdir, EMBEDDINGS_FILE)
  np.save(path, np.concatenate(embeddings))
  with open(os.path.join(workdir, FILES_FILE), 'w', newline='', encoding='utf-8') as file:
    csv.writer(file).writerows([('file',), *((name,) for name in paths)])
  logging.info('Wrote %d embeddings of %d features to %s (their files: %s).', len(paths),
               embeddings[0].shape[-1], path, os.path.join(workdir, FILES_FILE))
  return path

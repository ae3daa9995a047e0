"""`--mode=embed`: each backbone's pooled features (`pre_logits`) are timm's
`forward_head(forward_features(x), pre_logits=True)` for the same seeded weights, and the mode
writes them for every readable image under --inputs, in the order its CSV names."""

import csv
import os

import numpy as np
import pytest

from backbones import weights
from configs import default
from core import errors
import image_folders
import modes
from modes import embed
from modes import predict
from training import run_spec
from tests.helpers import timm_models
from tests.helpers.build import create_backbone
from tests.helpers.optional import requires_extras


@pytest.mark.parametrize('name,options', [
    ('resnet18', {}), ('vit_tiny_patch16_224', {'img_size': 64}),
    *(pytest.param(name, {}, marks=pytest.mark.slow)  # 20-30 s each on 2 cores.
      for name in ('convnext_tiny', 'efficientnet_b0', 'mobilenetv3_large_100'))])
def test_pooled_features_are_timms(name, options, tmp_path):
  torch_model = timm_models.timm_model(name, **options)
  path = timm_models.save_safetensors(torch_model, tmp_path / 'weights.safetensors')
  model = create_backbone(name, image_shape=(64, 64, 3), num_classes=timm_models.NUM_CLASSES)
  weights.load_pretrained(model, name, path)
  timm_models.assert_same_pooled_features(torch_model, model, timm_models.images(64, 64))


def _config(root: str, weights_file: str, model: str = 'resnet18'):
  config = default.get_config()
  config.update(dict(data_source='folder', dataset=root, train_split='train', eval_split='test',
                     model=model, init_from=weights_file, preprocess='resize(64)',
                     eval_batch_size=8))
  return config


def test_embed_writes_every_images_features_in_the_order_of_its_csv(tmp_path):
  """Imported timm weights, never trained: the rows of embeddings.npy are timm's features of
  the images predict reads, in the order embeddings.csv names them; a damaged file is
  skipped."""
  requires_extras('timm', 'torch', 'safetensors')
  root = str(tmp_path / 'shapes')
  image_folders.make_shapes_folder(root, {'train': 2, 'test': 4}, image_sizes=(40, 90))
  inputs = os.path.join(root, 'test')
  damaged = os.path.join(inputs, 'damaged.jpg')
  with open(damaged, 'wb') as file:
    file.write(b'\xff\xd8\xff not a JPEG')
  torch_model = timm_models.timm_model('resnet18')
  weights_file = timm_models.save_safetensors(torch_model, tmp_path / 'resnet18.safetensors')
  run = run_spec.resolve(_config(root, weights_file))
  workdir = str(tmp_path / 'embeddings')

  path = embed.embed(run, workdir, inputs)
  embeddings = np.load(path)
  with open(os.path.join(workdir, embed.FILES_FILE), newline='', encoding='utf-8') as file:
    rows = list(csv.reader(file))
  assert rows[0] == ['file'] and len(rows) - 1 == len(embeddings) == 12
  assert damaged not in {row[0] for row in rows}
  # What predict reads of each file, through timm.
  images = predict.read_images(run, modes.dataset_info(run, workdir), inputs)
  read = {path.decode(): image for batch in images.batches.as_numpy_iterator()
          for path, image in zip(batch['path'], batch['image'])}
  expected = timm_models.pooled_features(torch_model, np.stack(
      [read[row[0]] for row in rows[1:]]).astype(np.float32) / 255)
  np.testing.assert_allclose(embeddings, expected, atol=1e-4 * np.abs(expected).max())


def test_a_model_without_pooled_features_is_refused_before_any_data_is_read(tmp_path):
  config = default.get_config()  # The CNN.
  with pytest.raises(errors.ConfigError) as error:
    embed.embed(run_spec.resolve(config), str(tmp_path), str(tmp_path / 'no_such_folder'))
  assert (error.value.key, error.value.value) == ('model', 'cnn')
  assert not os.listdir(tmp_path)

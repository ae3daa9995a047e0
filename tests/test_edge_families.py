"""The families people ship to phones and microcontrollers, under timm's names: EfficientNet
B1-B3 and Lite0-4, TensorFlow's ports (tf_efficientnet_b0, tf_efficientnet_lite0), MobileNetV2
and MobileNetV3-Small. Each gives timm's logits from timm's weights (seeded random ones stand in
for the downloads), declares timm's pretrained_cfg, and fine-tunes from imported weights into
TFLite and ONNX exports that compute what predict computes."""

import csv

import numpy as np
import pytest
import tensorflow as tf

import sample_folders
from modes import export
from modes import predict
from tests.helpers import timm_models as timm_helpers
from tests.helpers.optional import requires_extras
import kernels
from training import run_spec

EDGE = ('efficientnet_b1', 'efficientnet_b2', 'efficientnet_b3', 'efficientnet_lite0',
        'efficientnet_lite1', 'efficientnet_lite2', 'efficientnet_lite3', 'efficientnet_lite4',
        'tf_efficientnet_b0', 'tf_efficientnet_lite0', 'mobilenetv2_100',
        'mobilenetv3_small_100')
# 64 px keeps the CPU's work small; odd, 65 px, pads TensorFlow's 'SAME' otherwise at the
# stride-2 layers than 64 px does.
SIZE, ODD_SIZE = 64, 65


@pytest.mark.parametrize('name,layers,size', [
    *[pytest.param(name, kernels.STOCK_LAYERS, SIZE, id=name) for name in EDGE],
    pytest.param('tf_efficientnet_b0', kernels.STOCK_LAYERS, ODD_SIZE, id='tf_b0-odd'),
    # The XLA:CPU layers' depthwise convolutions with 'SAME' padding and ReLU6.
    pytest.param('tf_efficientnet_lite0', kernels.CPU_LAYERS, ODD_SIZE, id='tf_lite0-cpu_layers')])
def test_same_logits_and_parameters_as_timm(name, layers, size, tmp_path):
  timm_helpers.assert_imports_as_timm(name, size, layers, tmp_path)


@pytest.mark.parametrize('name', EDGE)
def test_pretrained_cfg_is_timms_default(name):
  timm_helpers.assert_pretrained_cfg_is_timms(name)


@pytest.mark.slow
def test_fine_tuned_from_timms_weights_into_tflite_and_onnx(tmp_path):
  """configs/finetune.py on a photo folder from timm's weights of TensorFlow's EfficientNet-Lite0
  port (all but the head loaded); the TFLite and ONNX exports of the result give predict's
  classes on the folder's photos, prepared as the model card says. One model: the other new
  layer kinds go through every format at small widths (tests/test_export.py's families), and
  each fine-tune costs a minute of CI."""
  name = 'tf_efficientnet_lite0'
  requires_extras('jax2onnx', 'onnxruntime', 'ai_edge_litert')
  from configs import finetune  # pylint: disable=g-import-not-at-top
  import train  # pylint: disable=g-import-not-at-top
  root = str(tmp_path / 'photos')
  sample_folders.make_kind_folder(root, 'shapes', num_images=24, image_sizes=(200, 240),
                                  messy=False, formats=('PNG',))
  path = timm_helpers.save_safetensors(timm_helpers.timm_model(name), tmp_path / 'w.safetensors')
  config = finetune.get_config()
  config.update(dict(dataset=root, model=name, init_from=path, num_epochs=1, batch_size=8,
                     eval_batch_size=8, evaluators='accuracy',
                     preprocess=f"random_resized_crop({SIZE}, interpolation='bicubic')|flip_lr|"
                     "normalize('imagenet')"))
  run = run_spec.resolve(config)
  workdir = str(tmp_path / 'workdir')
  metrics = train.train_and_evaluate(run, workdir)
  assert 0 <= metrics['eval/accuracy'] <= 1, metrics
  with open(predict.predict(run, workdir, root), newline='', encoding='utf-8') as file:
    rows = sorted(csv.DictReader(file), key=lambda row: row['file'])
  classifier = export.load_classifier(run, workdir)
  images = np.stack([classifier.prepare(tf.io.decode_png(tf.io.read_file(row['file']),
                                                         channels=3).numpy()[None])[0]
                     for row in rows])
  names = classifier.info.class_names
  for export_format in ('tflite', 'onnx'):
    exported = export.export(run, workdir, export_format)
    logits = export.format_named(export_format).run(exported, images)
    assert [names[index] for index in logits.argmax(-1)] == [row['class'] for row in rows], (
        export_format)

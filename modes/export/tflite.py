"""`--export_format=tflite`: `<workdir>/export_tflite/model.tflite`, for LiteRT
(`ai_edge_litert`), through TF's LiteRT converter; model-size images."""

import os
import tempfile
import time

import numpy as np
import tensorflow as tf

from modes import export
from modes.export import saved_model
from training import provenance

# The interpreter's speed on the card: calls before timing, and at least this many calls and
# seconds timed (a phone-sized model takes milliseconds a call).
_WARMUP_CALLS, _MIN_CALLS, _MIN_SECONDS = 3, 10, 1.0


@export.FORMATS.register('tflite')
class TFLite(export.Format):
  """A LiteRT flatbuffer with one signature, serving_default (`images` -> `logits`)."""
  directory = 'export_tflite'
  file = 'model.tflite'
  usage = ('ai_edge_litert.interpreter.Interpreter(model_path=path)'
           ".get_signature_runner()(images=images)['logits']")

  def write(self, classifier: export.Classifier, path: str) -> None:
    """LiteRT's converter reads a SavedModel: the fixed-size one, lowered for the CPU, where
    LiteRT runs it (its converter turns the jax2tf call into LiteRT ops)."""
    module = saved_model.tf_module(classifier, any_size=False, platforms=('cpu',))
    with tempfile.TemporaryDirectory() as directory:
      tf.saved_model.save(module, directory, signatures={'serving_default': module.predict})
      converted = tf.lite.TFLiteConverter.from_saved_model(directory).convert()
    with open(path, 'wb') as file:
      file.write(converted)

  def run(self, path: str, images: np.ndarray) -> np.ndarray:
    return _signature_runner(path)(images=images)['logits']

  def card_fields(self, classifier: export.Classifier, path: str) -> dict:
    """Its signature, and what a device that runs it needs to know: the file's size, and the
    interpreter's speed on one image at a time (LiteRT's default threads, this machine's
    CPU: `processor`), after a warm-up."""
    runner = _signature_runner(path)
    image = np.zeros((1, *classifier.info.image_shape), np.uint8)
    for _ in range(_WARMUP_CALLS):
      runner(images=image)
    calls, start = 0, time.perf_counter()
    while calls < _MIN_CALLS or time.perf_counter() - start < _MIN_SECONDS:
      runner(images=image)
      calls += 1
    return {'signatures': {'serving_default': ['logits']}, 'platforms': ['cpu'],
            'file_megabytes': round(os.path.getsize(path) / 1e6, 3),
            'interpreter_images_per_second_batch_1': round(
                calls / (time.perf_counter() - start), 1),
            'processor': provenance.processor()}


def _signature_runner(path: str):
  """LiteRT's runner of the serving_default signature of the TFLite file at `path`."""
  return export.require('ai_edge_litert.interpreter', 'tflite').Interpreter(
      model_path=path).get_signature_runner()

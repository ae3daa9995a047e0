"""`--export_format=tflite`: `<workdir>/export_tflite/model.tflite`, for LiteRT
(`ai_edge_litert`), through TF's LiteRT converter; model-size images."""

import tempfile

import numpy as np
import tensorflow as tf

from modes import export
from modes.export import saved_model


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
    interpreter = export.require('ai_edge_litert.interpreter', 'tflite').Interpreter(
        model_path=path)
    return interpreter.get_signature_runner()(images=images)['logits']

  def card_fields(self, classifier: export.Classifier) -> dict:
    del classifier  # The same for every model.
    return {'signatures': {'serving_default': ['logits']}, 'platforms': ['cpu']}

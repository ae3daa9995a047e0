"""`--export_format=stablehlo`: `<workdir>/export_stablehlo/model.stablehlo`, `jax.export`'s
serialized bytes (`jax.export.deserialize(data).call(images)`), for CPU and CUDA; model-size
images."""

import jax
import numpy as np

from modes import export


@export.FORMATS.register('stablehlo')
class StableHLO(export.Format):
  """The classifier's StableHLO, its weights as constants, its batch size symbolic."""
  directory = 'export_stablehlo'
  file = 'model.stablehlo'
  usage = "jax.export.deserialize(open(path, 'rb').read()).call(images)"

  def write(self, classifier: export.Classifier, path: str) -> None:
    batch, = jax.export.symbolic_shape('batch')
    exported = jax.export.export(jax.jit(classifier.closed), platforms=export.PLATFORMS)(
        classifier.images_spec(batch))
    with open(path, 'wb') as file:
      file.write(exported.serialize())

  def run(self, path: str, images: np.ndarray) -> np.ndarray:
    with open(path, 'rb') as file:
      return np.asarray(jax.export.deserialize(file.read()).call(images))

  def card_fields(self, classifier: export.Classifier, path: str) -> dict:
    del classifier, path  # The same for every model.
    return {'platforms': list(export.PLATFORMS)}

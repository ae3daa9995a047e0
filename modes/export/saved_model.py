"""`--export_format=saved_model` (the default): `<workdir>/export/`, a TF SavedModel for
TensorFlow and TF Serving. Images of any size, made the model's size by the TF ops of eval's
resize and crop, in front of the model converted with jax2tf (native serialization, for CPU and
CUDA). Signatures: serving_default (`logits`); classify (`class`, `probability`);
class_names."""

from jax.experimental import jax2tf
import numpy as np
import tensorflow as tf

from modes import export

_SIGNATURES = {'serving_default': ['logits'], 'classify': ['class', 'probability'],
               'class_names': ['class_names']}


def tf_module(classifier: export.Classifier, any_size: bool,
              platforms=export.PLATFORMS) -> tf.Module:
  """The classifier as a tf.Module: weights as TF variables, the JAX function through jax2tf;
  with `any_size`, eval's resize and crop (TF ops) in front."""
  module = tf.Module()
  module.weights = [tf.Variable(value, trainable=False, name=name)
                    for value, name in zip(classifier.weights, classifier.names)]
  converted = jax2tf.convert(classifier.logits, polymorphic_shapes=[None, '(batch, ...)'],
                             with_gradient=False, native_serialization_platforms=platforms)
  height, width, channels = classifier.info.image_shape
  images_spec = tf.TensorSpec((None, None if any_size else height, None if any_size else width,
                               channels), tf.uint8, name='images')

  def predict(images):
    if any_size:
      images = tf.ensure_shape(classifier.preprocess.resize(images, (height, width)),
                               (None, height, width, channels))
    return {'logits': converted(list(module.weights), images)}

  module.predict = tf.function(predict, autograph=False, input_signature=[images_spec])
  names = tf.constant(classifier.info.class_names)

  def classify(images):
    probabilities = tf.nn.softmax(module.predict(images)['logits'])
    return {'class': tf.gather(names, tf.argmax(probabilities, axis=-1)),
            'probability': tf.reduce_max(probabilities, axis=-1)}

  module.classify = tf.function(classify, autograph=False, input_signature=[images_spec])
  module.class_names = tf.function(lambda: {'class_names': names}, autograph=False,
                                   input_signature=[])
  return module


@export.FORMATS.register('saved_model')
class SavedModel(export.Format):
  """The SavedModel's directory, eval's resize and crop inside."""
  directory = 'export'
  any_size = True
  usage = "tf.saved_model.load(path).signatures['classify'](images=images)"

  def write(self, classifier: export.Classifier, path: str) -> None:
    module = tf_module(classifier, any_size=True)
    tf.saved_model.save(module, path, signatures={'serving_default': module.predict,
                                                  'classify': module.classify,
                                                  'class_names': module.class_names})

  def run(self, path: str, images: np.ndarray) -> np.ndarray:
    return tf.saved_model.load(path).signatures['serving_default'](
        images=tf.constant(images))['logits'].numpy()

  def card_fields(self, classifier: export.Classifier, path: str) -> dict:
    del classifier, path  # The same for every model.
    return {'signatures': _SIGNATURES, 'platforms': list(export.PLATFORMS)}

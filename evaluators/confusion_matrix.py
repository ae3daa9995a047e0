"""`confusion_matrix`: a picture of the confusion matrix."""

import numpy as np

import evaluators
from evaluators import EVALUATORS
from training import pictures

@EVALUATORS.register('confusion_matrix')
class ConfusionMatrix(evaluators.Confusion):
  """A picture of the confusion matrix, labelled with the class names: `confusion_matrix`."""
  name = 'confusion_matrix'

  def images(self, state, info):
    return {'confusion_matrix': pictures.confusion_matrix(np.asarray(state), info.class_names)}

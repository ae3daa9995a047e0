"""`balanced_accuracy`: the mean recall over the classes present."""

import numpy as np

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('balanced_accuracy')
class BalancedAccuracy(evaluators.Confusion):
  """The mean recall over the classes that have examples in the split: `balanced_accuracy`
  (scikit-learn's balanced_accuracy_score)."""
  name = 'balanced_accuracy'
  directions = {'balanced_accuracy': True}

  def results(self, state, info):
    scores = evaluators.class_scores(state)
    present = scores['support'] > 0
    return {'balanced_accuracy': float(scores['recall'][present].mean()) if present.any() else 0.0}

"""`per_class`: per-class precision, recall and F1, and their macro averages."""

import numpy as np

import evaluators
from evaluators import EVALUATORS

@EVALUATORS.register('per_class')
class PerClass(evaluators.Confusion):
  """Per-class precision, recall and F1 (in the eval report), and their macro averages:
  `macro_precision`, `macro_recall`, `macro_f1`, over the classes that occur in the split's
  labels or predictions (scikit-learn's average='macro')."""
  name = 'per_class'
  directions = {'macro_precision': True, 'macro_recall': True, 'macro_f1': True}

  def results(self, state, info):
    scores = evaluators.class_scores(state)
    occurring = (scores['support'] > 0) | (np.asarray(state).sum(axis=0) > 0)
    return {f'macro_{name}': float(scores[name][occurring].mean()) if occurring.any() else 0.0
            for name in ('precision', 'recall', 'f1')}

  def per_class(self, state, info):
    return evaluators.class_scores(state)

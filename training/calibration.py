"""Temperature scaling (Guo et al., 2017): one temperature T, fitted on the eval split after
training, divides the logits so that the softmax probabilities match the accuracy; the classes
(the argmax) are unchanged. Eval, predict and every export format apply the workdir's T.
"""

import json
import os

TEMPERATURE_FILE = 'temperature.json'  # In the workdir: {"temperature": T, ...}.


def saved_temperature(workdir: str) -> float:
  """The temperature fitted for `workdir`'s model; 1.0 (the logits as they are) when none was."""
  path = os.path.join(workdir, TEMPERATURE_FILE)
  if not os.path.exists(path):
    return 1.0
  with open(path, encoding='utf-8') as file:
    return float(json.load(file)['temperature'])

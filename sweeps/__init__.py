"""sweep.py's parts: the sweep spec (spec.py), main.py runs and their results (runs.py), and
the Optuna study that runs them (engine.py)."""

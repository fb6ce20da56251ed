"""``rltrain sweep``: grid or Optuna search over config overrides, trials on one Ray cluster.

expand.py (Hydra override grammar -> trials), trials.py (compose/validate/plan
each trial, its share of the cluster), scheduler.py (trial processes, resources,
Ctrl-C), search.py (Optuna), table.py (live table), results.py (sweep.json,
sweep.csv, reward plot), launch.py (the command), trial_main.py (one trial).
"""

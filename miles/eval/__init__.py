"""Evaluation: eval sets and their metrics (pass@k, avg@k, maj@k, greedy accuracy), run during
training through the rollout manager or alone by `miles eval`.

    config.py      EvalConfig, EvalSetConfig: [eval] and its [[eval.sets]]
    metrics.py     pass@k (unbiased), avg@k, maj@k, accuracy; answer extractors for maj@k
    evaluator.py   Evaluator: generates and scores every set on the run's engines
    standalone.py  `miles eval`: one engine on a checkpoint, every set, one JSON object

Non-goals: training-time reward statistics (rollout/stats.py), plotting (metrics/).
"""

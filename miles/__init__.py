"""miles: reinforcement-learning post-training for language models.

Rollout engines generate trajectories behind an HTTP contract; a trainer computes policy updates;
new weights reach every engine before it generates under the new policy.
"""

__version__ = "0.1.0"

"""Agents: multi-turn rollouts, where one sample is a whole episode of model turns and the replies
of an environment or of a user's own program, recorded as one token sequence.

    episode.py   the `agent` generate function: episodes against an Environment (environments/),
                 token-in/token-out, with per-turn weight versions and an episode timeout
    harness.py   the `harness` generate function: a user's openai-client program run once per sample
                 against a session of the session server (sessions/), its tokens trained as recorded

Both are registered in rollout/generate.py's GENERATE_FNS by `module:attr`, and their settings
(AgentConfig, HarnessConfig) live in rollout/config.py, so neither is imported until a run names it.
Non-goals: environments themselves (environments/), the HTTP session API (sessions/).
"""

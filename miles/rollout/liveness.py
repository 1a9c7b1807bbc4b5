"""Engine liveness: the one config that says how often engines are probed, how slow a probe may be
and how many misses in a row make an engine dead.

Two parts act on it: the router stops routing to an engine that crossed the threshold (quarantine)
and re-admits it once healthy at the fleet's weight version; the engine fleet of `miles train`
(orchestration/fleet.py) replaces it. Both read this section, so a run states liveness once.
Non-goals: the probes themselves (the router and the fleet each send theirs) and routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config import ConfigError


@dataclass
class HealthConfig:
    enabled: bool = True
    """Replace engines that die or stall, and re-admit engines the run did not start once they answer
    again (the fleet of `miles train`, which needs its router); the router checks its engines either
    way, since it must know where it may route."""
    interval_s: float = 1.0
    """Seconds between two probe rounds of every serving engine (the router's and the fleet's)."""
    timeout_s: float = 5.0
    """A probe slower than this is a miss; the fleet's /health_generate probe is excused while /health
    still answers within it (a busy engine); a stalled engine answers neither."""
    failure_threshold: int = 2
    """Consecutive misses (probes, or requests that failed before an answer) after which an engine is
    quarantined by the router and declared dead by the fleet."""
    restart: bool = True
    """Start a replacement in the dead engine's slot; false only removes it from the fleet. Engines the run
    did not start (rollout.engine_urls) are never restarted: they are routed around and re-admitted,
    brought to the fleet's weights, once they answer again."""
    standby_engines: int = 0
    """Engines started ahead of need, idle, so a replacement skips process start-up (seconds)."""
    max_replacements: int = 100
    """Most replacements in one run; past that a failing engine is only removed (a crash loop stops)."""
    admit_timeout_s: float = 120.0
    """Longest a new engine may take from start to router admission before the run fails."""

    def validate(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.admit_timeout_s <= 0:
            raise ConfigError("health.interval_s, health.timeout_s and health.admit_timeout_s must be > 0")
        if self.failure_threshold < 1 or self.standby_engines < 0 or self.max_replacements < 0:
            raise ConfigError("health.failure_threshold >= 1, health.standby_engines >= 0 and "
                              "health.max_replacements >= 0 are required")

    def dead(self, consecutive_misses: int) -> bool:
        """Whether this many misses in a row take an engine out of service."""
        return consecutive_misses >= self.failure_threshold

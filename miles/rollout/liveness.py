"""Engine liveness, decided in one place: the config that says how often engines are probed, how slow
a probe may be and how many misses in a row make an engine dead, and the probes with their verdicts.

Two parts act on it: the router stops routing to an engine that crossed the threshold (quarantine)
and re-admits it once healthy at the fleet's weight version; the engine fleet of `miles train`
(orchestration/) replaces it. Both probe through `Liveness` and count misses with `HealthConfig.dead`,
so a run states liveness once and both sides read an answer the same way:

    serving (the router's, async)    /health 200 within timeout_s, then the weight version in force
    generating (the fleet's, sync)   /health_generate 200 within timeout_s, or 503 "paused" (paused
                                     on purpose); a timeout is excused while /health still answers
                                     (a busy engine; a stopped or wedged process answers neither)
Non-goals: when to probe and what to do about a dead engine (the router's loop, the fleet's monitor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from miles.config import ConfigError
from miles.engine_api import routes
from miles.engine_api.errors import EngineError
from miles.versions import from_wire


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


class Liveness:
    """The probes of `cfg`, sent with `client` (an engine_api EngineClient): None when the engine is
    alive, else why not (the text a replacement record or a router's worker carries)."""

    def __init__(self, cfg: HealthConfig, client):
        self.cfg, self.client = cfg, client

    async def serving(self, url: str) -> tuple[str | None, int | None]:
        """The router's check: (None, weight version) for an engine that may serve, (why, None) if not."""
        timeout = self.cfg.timeout_s
        try:
            status, _, _ = await self.client.asend("GET", url, routes.HEALTH, timeout=timeout)
            if status != 200:
                raise RuntimeError(f"{routes.HEALTH} answered {status}")
            # SGLang's route for the version in force (a string; "default" before any update).
            status, content, _ = await self.client.asend("GET", url, routes.GET_MODEL_INFO, timeout=timeout)
            version = from_wire(json.loads(content).get("weight_version")) if status == 200 else None
        except Exception as exc:  # noqa: BLE001 - any failure is a failed check
            return f"health check: {type(exc).__name__}: {exc}", None
        return None, version

    def generating(self, url: str) -> str | None:
        """The fleet's check: None if the engine generated a token within timeout_s (or is busy or paused)."""
        timeout = self.cfg.timeout_s
        try:
            r = self.client.send("GET", url, routes.HEALTH_GENERATE, timeout=timeout)
        except EngineError as exc:
            if not exc.timed_out:
                return str(exc)
            # A full batch queues the probe's token behind it; an engine whose server still answers
            # is busy, not stalled (a stopped or wedged process answers neither).
            if self.client.health(url, timeout):
                return None
            return f"{exc.cause}: no answer within health.timeout_s = {timeout:g}s"
        if r.status_code == 200 or (r.status_code == 503 and "paused" in r.text):
            return None  # paused on purpose (a verified weight push, a pause mode): alive and answering
        return f"{routes.HEALTH_GENERATE} answered {r.status_code}: {r.text[:120]}"

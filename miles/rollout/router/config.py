"""The router's own settings: which router, where it listens, how requests stick and are retried.

How engines are judged alive lives in the one liveness section (miles/rollout/liveness.py), shared
with the engine fleet. Non-goal: anything that needs FastAPI (config loading must stay light).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config import ConfigError
from miles.net import DEFAULT_MAX_BODY_MB, LOOPBACK, check_admin_exposure

ROUTER_KINDS = ("miles", "sglang")


@dataclass
class RouterConfig:
    kind: str = "miles"
    """Which router fronts the engines: "miles" (built in) or "sglang" (the Rust sglang-router package)."""
    host: str = LOOPBACK
    """Interface the router binds to; loopback unless clients on other hosts must reach it (which
    needs admin_token, or insecure_admin)."""
    port: int = 0
    """HTTP port; 0 picks a free one."""
    routing_key_header: str = "X-Routing-Key"
    """Requests carrying this header stick to the engine that served the same key before."""
    max_retries: int = 2
    """Other engines a request is retried on when its engine fails before answering."""
    request_timeout_s: float = 600.0
    """Longest a proxied request may take; a timed-out request is answered 504 and not retried."""
    admin_token: str | None = None
    """When set, /add_worker, /remove_worker, /flush_cache and aborting every request need
    `Authorization: Bearer <token>`; the router forwards it to the engines only on such authorized
    calls. `miles train` sets a fresh random one (`--resume`: the one of the run's router it adopts)."""
    insecure_admin: bool = False
    """Allow binding a non-loopback host without admin_token, leaving every admin route open to the
    network; only for a network whose every user is trusted."""
    max_request_mb: float = DEFAULT_MAX_BODY_MB
    """Largest request body the router reads; larger ones are answered 413."""
    own_process: bool = False
    """`miles train` only (its default is true there)."""
    exit_without_engines_s: float = 0.0
    """A router process with no engine serving for this long exits (one whose driver and engines
    died and that no `--resume` adopted); 0: never."""

    def validate(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ConfigError(f"router.kind: {self.kind!r} is not a router; use one of {list(ROUTER_KINDS)}")
        if self.max_retries < 0:
            raise ConfigError("router.max_retries must be >= 0")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"router.request_timeout_s = {self.request_timeout_s}: set it > 0 (seconds)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"router.port = {self.port}: set it in 0..65535 (0 picks a free port)")
        if self.exit_without_engines_s < 0:
            raise ConfigError(f"router.exit_without_engines_s = {self.exit_without_engines_s}: set it >= 0 "
                              "(seconds; 0 never exits)")
        if self.max_request_mb <= 0:
            raise ConfigError(f"router.max_request_mb = {self.max_request_mb}: set it > 0 (64 is the default)")

    def check_admin_exposure(self) -> None:
        """Refuse a tokenless router on a non-loopback host (see net.check_admin_exposure). Not part of
        validate(): a run's router gets its token only when the run starts it."""
        check_admin_exposure(self.host, self.admin_token, self.insecure_admin, "router")

    def check_features(self, *, return_routed_experts: bool = False) -> None:
        """Refuse a router that would silently drop what a feature of this run needs."""
        if self.kind == "sglang" and return_routed_experts:
            raise ConfigError(
                "router.kind = 'sglang' drops routed experts from /generate responses, which routing "
                "replay (R3) needs: set router.kind = 'miles' or turn off return_routed_experts")


def check_url(url: str) -> str:
    """An engine URL without its trailing slash; ValueError names the expected form."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url: {url!r} is not an engine URL; send http://host:port")
    return url.rstrip("/")


@dataclass
class RunRouterConfig(RouterConfig):
    """RouterConfig as a section of the run config: the router `miles train` starts."""

    host: str = ""
    """Interface the router binds to and advertises; empty: the address of the driver's Ray node
    (loopback in a local run)."""
    own_process: bool = True
    """Serve the router from a process of its own, in its own session, restarted on its port if it
    dies; it outlives a killed driver, and `miles train --resume` adopts it (false: a thread of the
    driver, which shares the driver's fate)."""
    exit_without_engines_s: float = 3600.0
    """The router process (own_process) exits after this long with no engine serving: a run's driver and
    engines died and no `miles train --resume` adopted it within the hour; 0: never."""

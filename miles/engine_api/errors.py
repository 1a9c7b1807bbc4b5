"""The contract's errors: what an engine answers when it refuses or fails a request, and what a
client raises when an engine call fails.

Engine side (each maps to one HTTP status, the same on every engine speaking the contract):
    InvalidRequest   400  the request is wrong; the message names the field and the fix
    RequestFailed    422  accepted, but its step raised even alone; sent again it fails again
    EngineStepFailed 503  its batch step failed twice, no request of it alone; a retry may succeed
Client side: EngineError, the one error of EngineClient (client.py). It names the engine (URL) and
the route, and says what the engine answered: its status and the start of its body, or that nothing
came back (`status` None), and then whether it timed out or could not be reached at all.
Non-goal: the sync transports' failures (sync/transports/base.py's TransportError is an EngineError
raised for a whole weight version).
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the offending field (HTTP 400)."""


class RequestFailed(Exception):
    """An accepted request whose step raised even when it ran alone (HTTP 422): sent again as it is, it
    fails again. The requests batched with it were not affected."""


class EngineStepFailed(Exception):
    """A request whose batch step raised twice while no request of it failed alone (HTTP 503): the
    fault lies in the combination or in the engine, so a retry may succeed."""


# How much of an engine's answer an error quotes: enough for its reason, not a whole page.
BODY_EXCERPT = 200


class EngineError(RuntimeError):
    """A call to an engine (or a router in front of engines) that failed.

    url, path: which engine and which route (None for an error about several engines; the message
    names each). status: what it answered, None when no answer came back; body: the start of that
    answer. timed_out: no answer within the timeout (the engine may still be working on it);
    unreachable: no answer because the connection failed or dropped (nothing was delivered, so
    another engine may take the request); cause: the name of the client-side error behind a missing
    answer (ReadTimeout, ConnectError, ...)."""

    def __init__(self, message: str, *, url: str | None = None, path: str | None = None,
                 status: int | None = None, body: str | None = None, timed_out: bool = False,
                 unreachable: bool = False, cause: str | None = None):
        super().__init__(message)
        self.url, self.path, self.status, self.body = url, path, status, body
        self.timed_out, self.unreachable, self.cause = timed_out, unreachable, cause

    @classmethod
    def answered(cls, url: str, path: str, status: int, text: str, reason: str | None = None) -> EngineError:
        """The engine answered `status` (not 200); `reason` is its own (SGLang's `error` or `message`)."""
        body = text[:BODY_EXCERPT]
        return cls(f"engine {url}: {path} returned HTTP {status}: {reason or body}", url=url, path=path,
                   status=status, body=body)

    @classmethod
    def no_answer(cls, url: str, path: str, exc: BaseException, timed_out: bool, unreachable: bool) -> EngineError:
        return cls(f"engine {url}: {path} failed to respond ({type(exc).__name__}: {exc})", url=url, path=path,
                   timed_out=timed_out, unreachable=unreachable, cause=type(exc).__name__)

    @classmethod
    def of_many(cls, errors: list[BaseException]) -> EngineError:
        """One error for a call to several engines, naming every one that failed."""
        return cls("; ".join(str(e) for e in errors))

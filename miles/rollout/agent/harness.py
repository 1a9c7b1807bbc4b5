"""Black-box harnesses: a user's own agent program, written against the `openai` client, trained by
`miles train` (rollout.generate_fn = "harness").

For every sample the program runs once, as a child process (`rollout.agent.harness.command`) or as
a Python function (`.function`), pointed at a fresh session of the run's session API
(rollout/sessions/) through OPENAI_BASE_URL and OPENAI_API_KEY. Whatever the program does between its
chat completions (tools, shells, retries, frameworks) is its own business; what is trained is the
session's trajectory: the exact token ids the engine saw and generated, loss mask 1 on the model's
tokens only, the engine's logprobs and one weight version per model turn.

The program learns its task from (any of):
    MILES_PROMPT        the prompt's text          MILES_EPISODE   a JSON file: prompt, messages,
    stdin               the same JSON                              label, metadata, index, sample
The reward is (rollout.agent.harness.reward):
    "program"  the program's last line on stdout: a number, or a JSON object with a "reward" number;
               a function returns the number;
    "run"      the run's reward (rollout.reward) over the session's last assistant reply and the label.

An episode fails when the program exits non-zero, runs past rollout.agent.episode_timeout_s (its
whole process group is killed), or gives no reward; failures are counted (rollout/harness_failures,
rollout/harness_timeouts) and handled as reward errors are: on_failure = "score" keeps the episode's
tokens with fallback_score, "drop_group" gives its group to buffer.on_failure; an episode in which
the model never spoke is always given up (nothing to train). Past max_failure_rate the run stops
with the program's own last output. The session's budget (rollout.agent.max_turns,
.max_response_tokens) ends an episode as truncated: requests past it get a 400, and the program's
reaction to that is not counted as a failure. Sampling is the run's (rollout.temperature, top_p,
top_k) whatever the program asks, since the trainer's logprobs assume it, and a turn is at most
rollout.max_new_tokens long.

At most max_concurrent programs run at once; evaluation runs the program too (its reward is the
eval score), so eval.num_prompts episodes share those slots.

Non-goals: sandboxing the program (it runs as the run's user: use a container or the terminal
environment's sandbox for untrusted code), several sessions per sample, reading the program's
intermediate rewards.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import secrets
import shlex
import signal
import tempfile
import threading
import weakref
from dataclasses import dataclass

from miles.buffer.types import Sample, SampleStatus
from miles.registry import load_attr
from miles.rollout.config import HarnessConfig
from miles.rollout.sessions.server import start_session_server
from miles.rollout.sessions.store import SessionLimits

_KEEP_OUTPUT = 4096  # characters of a failed program's output quoted in errors and metadata
_KEEP_BYTES = 1 << 20  # bytes of a program's output held while it runs
_SECRET_ENV = ("MILES_ENGINE_ADMIN_TOKEN",)  # never handed to a user's program


@dataclass(frozen=True)
class Episode:
    """What a harness function is given; a command gets the same as env vars and JSON."""

    base_url: str          # OPENAI_BASE_URL
    api_key: str           # OPENAI_API_KEY
    prompt: str
    messages: list | None
    label: str | None
    metadata: dict
    index: int
    sample: int

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "messages": self.messages, "label": self.label, "metadata": self.metadata,
                "index": self.index, "sample": self.sample}


class HarnessError(RuntimeError):
    """Too many episodes failed; the message quotes the program's last output."""


class _Failure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Counters:
    """Episodes and failures: since the last report (metrics) and over the run (max_failure_rate)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.episodes = self.failed = 0
        self.window = {"episodes": 0, "failures": 0, "timeouts": 0, "truncated": 0}

    def add(self, failure: str | None, truncated: bool) -> None:
        with self.lock:
            self.episodes += 1
            self.window["episodes"] += 1
            self.window["truncated"] += truncated
            if failure is not None:
                self.failed += 1
                self.window["failures"] += 1
                self.window["timeouts"] += failure == "timeout"

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {f"rollout/harness_{k}": float(v) for k, v in self.window.items()}
            self.window = dict.fromkeys(self.window, 0)
        return out


_counters = _Counters()
_servers: dict[tuple, object] = {}
_servers_lock = threading.Lock()
# One semaphore per event loop (an asyncio.Semaphore belongs to the loop it was first used on).
_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _slot(limit: int) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(limit or 2 * (os.cpu_count() or 1))
    return _slots[loop]


def _session_server(ctx, parser: str):
    """This process's session server for the run's tokenizer (started on the first episode)."""
    key = (id(ctx.tokenizer), ctx.agent.turn_end_token, parser)
    with _servers_lock:
        if key not in _servers:
            _servers[key] = start_session_server(ctx.url, tokenizer=ctx.tokenizer, tool_parser=parser,
                                                 turn_end_token=ctx.agent.turn_end_token,
                                                 default_max_tokens=ctx.agent.max_response_tokens)
        return _servers[key]


async def harness(ctx, prompt, params, rid: str) -> Sample:
    """One episode of the configured program on `prompt`; the session's tokens become the Sample."""
    cfg: HarnessConfig = ctx.agent.harness
    server = _session_server(ctx, cfg.tool_parser)
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    limits = SessionLimits(max_turns=ctx.agent.max_turns, max_response_tokens=ctx.agent.max_response_tokens,
                           max_new_tokens=params.max_new_tokens, sampling=sampling)
    api_key = secrets.token_urlsafe(16)
    sid = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in rid)
    session = server.new_session(sid, engine_url=ctx.url, api_key=api_key, limits=limits)
    episode = Episode(server.base_url(sid), api_key, prompt.text, prompt.messages, prompt.label,
                      dict(prompt.metadata), prompt.index, int(rid.split("-")[1]) if rid.count("-") >= 2 else 0)
    failure: _Failure | None = None
    reward: float | None = None
    output = bytearray()
    try:
        try:
            async with _slot(cfg.max_concurrent):
                reward = await asyncio.wait_for(_run(cfg, episode, output), ctx.agent.episode_timeout_s)
        except asyncio.TimeoutError:
            # The program is gone; a turn it was waiting for would keep the engine busy for nothing.
            await _abort(ctx, f"{sid}-{len(session.weight_versions)}")
            failure = _Failure("timeout", f"the harness ran past rollout.agent.episode_timeout_s = "
                                          f"{ctx.agent.episode_timeout_s:g}s and was killed; its last output:\n"
                                          f"{output.decode(errors='replace')[-_KEEP_OUTPUT:]}")
        except _Failure as f:
            # A program that stops when its budget is refused ended a truncated episode, not a crash.
            if not (session.exhausted and f.kind == "exit"):
                failure = f
        if failure is None and cfg.reward == "run":
            reward = await asyncio.to_thread(ctx.reward_fn, session.last_content, prompt.label)
        elif failure is None and reward is None and not session.exhausted:
            failure = _Failure("no_reward", "the harness gave no reward: print a number or {\"reward\": x} as the "
                                            "last line of stdout, return one from the function, or set "
                                            "rollout.agent.harness.reward = \"run\"")
    finally:
        session.close()  # a turn still generating for a killed program is not recorded
        server.store.sessions.pop(sid, None)
    return _sample(session, prompt, cfg, reward, failure)


harness.scores_itself = True  # type: ignore[attr-defined]


def take_metrics() -> dict[str, float]:
    """rollout/harness_episodes, _failures, _timeouts, _truncated since the last call."""
    return _counters.take()


harness.take_metrics = take_metrics  # type: ignore[attr-defined]


def _sample(session, prompt, cfg: HarnessConfig, reward: float | None, failure: _Failure | None) -> Sample:
    spoke = bool(session.weight_versions)
    _counters.add(failure.kind if failure else ("silent" if not spoke else None), bool(session.exhausted))
    _check_rate(cfg, failure)
    sample = session.to_sample(reward=cfg.fallback_score if reward is None else float(reward), label=prompt.label,
                               prompt_index=prompt.index)
    sample.metadata = dict(prompt.metadata)
    if failure is not None:
        sample.metadata["harness_failure"] = f"{failure.kind}: {str(failure)[:_KEEP_OUTPUT]}"
    if not spoke or (failure is not None and cfg.on_failure == "drop_group"):
        sample.status = SampleStatus.ABORTED  # the group goes to buffer.on_failure
    return sample


def _check_rate(cfg: HarnessConfig, failure: _Failure | None) -> None:
    with _counters.lock:
        episodes, failed = _counters.episodes, _counters.failed
    if failure is None or episodes < cfg.min_episodes or failed / max(episodes, 1) <= cfg.max_failure_rate:
        return
    raise HarnessError(f"{failed} of {episodes} harness episodes failed, more than "
                       f"rollout.agent.harness.max_failure_rate = {cfg.max_failure_rate}; the latest: {failure}")


async def _run(cfg: HarnessConfig, ep: Episode, out: bytearray) -> float | None:
    if cfg.function:
        fn = load_attr(cfg.function, "harness function")
        try:
            out = await fn(ep) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, ep)
        except Exception as e:  # noqa: BLE001 - the user's program failing is an episode failure, counted
            raise _Failure("exit", f"{cfg.function} raised {type(e).__name__}: {e}") from None
        return None if out is None else _number(out, cfg.function)
    return await _run_command(cfg, ep, out)


async def _run_command(cfg: HarnessConfig, ep: Episode, out: bytearray) -> float | None:
    """Run the command; `out` holds the tail of what it printed, also when a timeout cancels this."""
    payload = json.dumps(ep.to_json(), ensure_ascii=False)
    with tempfile.TemporaryDirectory(prefix="miles-harness-") as tmp:
        episode_file = os.path.join(tmp, "episode.json")
        with open(episode_file, "w") as f:
            f.write(payload)
        env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
        env.update(cfg.env)
        env.update({"OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": ep.api_key, "MILES_PROMPT": ep.prompt,
                    "MILES_EPISODE": episode_file})
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(cfg.command), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=env, cwd=cfg.cwd or os.getcwd(), start_new_session=True)
        reader = asyncio.ensure_future(_drain(proc.stdout, out))
        try:
            try:
                proc.stdin.write(payload.encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the program does not read stdin
            await proc.wait()
        finally:
            _kill_group(proc.pid)  # its own background children too, whether it ended or timed out
            await proc.wait()  # reaped here, also when the timeout cancelled us
            # A child that left the group may hold the pipe open: what was read by now is all there is.
            if not (await asyncio.wait({reader}, timeout=5))[0]:
                reader.cancel()
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            raise _Failure("exit", f"`{cfg.command}` exited with status {proc.returncode}; its last output:\n"
                                   f"{text[-_KEEP_OUTPUT:]}")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if cfg.reward == "run" or not lines:
            return None
        try:
            return _number(json.loads(lines[-1]), cfg.command)
        except ValueError:
            raise _Failure("no_reward", f"the last line `{cfg.command}` printed is not a reward (a number or "
                                        f"{{\"reward\": x}}): {lines[-1][:200]!r}") from None


async def _abort(ctx, rid: str) -> None:
    try:
        await ctx.client.post(f"{ctx.url}/abort_request", json={"rid": rid}, timeout=5)
    except Exception:  # noqa: BLE001 - the episode is already given up; a dead engine is reported elsewhere
        pass


async def _drain(stream, out: bytearray) -> None:
    while chunk := await stream.read(65536):
        out += chunk
        del out[:-_KEEP_BYTES]  # only the tail is read (the reward line) or quoted


def _number(value, where: str) -> float:
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Failure("no_reward", f"{where} returned {value!r}, not a reward number")
    return float(value)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

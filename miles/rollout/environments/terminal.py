"""Small terminal tasks: create or inspect files with shell commands, checked by a verifier.

Each episode gets its own sandbox (environments/sandbox.py) seeded with the task's files. Every model
turn is one shell command; the environment answers with its (truncated) output. The turn `done`
(or running out of commands) ends the episode: the task's verifier runs in the same sandbox and the
reward is 1.0 when it exits 0. The verifier is a command string held here, not a file the agent
could rewrite. Non-goals: long-lived shells (each command starts fresh in the same directory),
interactive programs, network access.

The tasks live here, with the environment that reads their files and verifiers; `task_source` is
their prompt source, registered in data/tasks as `terminal`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from miles.rollout.environments.contract import StepResult
from miles.rollout.environments.sandbox import Sandbox, SandboxError
from miles.data.tasks.contract import Problem

DONE = "done"


@dataclass(frozen=True)
class TerminalTask:
    name: str
    instruction: str
    files: tuple[tuple[str, str], ...]  # (relative path, content) written before the first command
    verifier: str                       # shell command; exit 0 = solved
    solution: str                       # a reference command (demonstrations and the oracle check)


TASKS: tuple[TerminalTask, ...] = (
    TerminalTask("hello_file", "Create a file named hello.txt containing the word hello.", (),
                 'test "$(cat hello.txt)" = hello', "echo hello > hello.txt"),
    TerminalTask("touch_done", "Create an empty file named ready.", (), "test -f ready && ! test -s ready",
                 "touch ready"),
    TerminalTask("count_lines", "Write the number of lines in data.txt to count.txt.",
                 (("data.txt", "".join(f"row {i}\n" for i in range(17))),),
                 'test "$(tr -d " \\n" < count.txt)" = 17', "wc -l < data.txt > count.txt"),
    TerminalTask("first_line", "Write the first line of notes.txt to first.txt.",
                 (("notes.txt", "alpha\nbeta\ngamma\n"),), 'test "$(cat first.txt)" = alpha',
                 "head -n 1 notes.txt > first.txt"),
    TerminalTask("move_into_dir", "Make a directory named out and move report.txt into it.",
                 (("report.txt", "quarterly numbers\n"),), "test -f out/report.txt && ! test -e report.txt",
                 "mkdir out && mv report.txt out/"),
    TerminalTask("delete_logs", "Delete every .log file here but keep the other files.",
                 (("a.log", "x\n"), ("b.log", "y\n"), ("keep.txt", "z\n")),
                 "test -f keep.txt && ! ls *.log >/dev/null 2>&1", "rm *.log"),
    TerminalTask("sort_names", "Sort the lines of names.txt alphabetically into sorted.txt.",
                 (("names.txt", "carol\nalice\nbob\n"),), 'test "$(cat sorted.txt)" = "$(printf "alice\\nbob\\ncarol")"',
                 "sort names.txt > sorted.txt"),
    TerminalTask("find_key", "secret.txt has a line key=VALUE. Write VALUE to key.txt.",
                 (("secret.txt", "user=ann\nkey=orchid\nmode=rw\n"),), 'test "$(cat key.txt)" = orchid',
                 "sed -n 's/^key=//p' secret.txt > key.txt"),
)
BY_NAME = {t.name: t for t in TASKS}


class TerminalTaskSource:
    """Prompts for the data source: each is a task's instruction, labelled with the task's name."""

    def __init__(self, split: str = "train", seed: int = 0):
        self.rng = random.Random(f"terminal:{seed}:{split}")
        self.order: list[TerminalTask] = []

    def take(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = list(TASKS)
                self.rng.shuffle(self.order)
            t = self.order.pop()
            out.append(Problem(prompt=t.instruction, answer=t.name))
        return out


def task_source(cfg, split: str, seed: int) -> TerminalTaskSource:
    """The `terminal` prompt source (rollout.task.name = "terminal"); the task config has no knobs for it."""
    return TerminalTaskSource(split=split, seed=seed)


class TerminalEnv:
    """One terminal episode: a fresh sandbox with the task's files, one shell command per turn."""

    def __init__(self, max_commands: int = 4, sandbox_config=None):
        self.max_commands = max_commands
        self.sandbox_config = sandbox_config
        self.sandbox = None
        self.task: TerminalTask | None = None
        self.commands = 0
        self.transcript: list = []  # CommandResults, for reports and tests

    def reset(self, task) -> str:
        if task.label not in BY_NAME:
            raise ValueError(f"terminal task {task.label!r} is unknown: the prompt's label must be one of "
                             f"{sorted(BY_NAME)}")
        self.close()
        self.task, self.commands, self.transcript = BY_NAME[task.label], 0, []
        self.sandbox = Sandbox(self.sandbox_config)
        for path, content in self.task.files:
            self.sandbox.write_file(path, content)
        return f"{self.task.instruction}\nReply with one shell command per turn; reply {DONE} when finished."

    def step(self, action: str) -> StepResult:
        if self.sandbox is None:
            raise RuntimeError("TerminalEnv.step before reset: call reset(task) first")
        command = action.strip()
        if command and command != DONE:
            self.commands += 1
            try:
                result = self.sandbox.run(command)
                reply = result.observation() or "(no output)"
                self.transcript.append(result)
            except SandboxError as e:  # the model wrote something no shell can run; tell it why
                reply = f"error: {e}"
            if self.commands < self.max_commands:
                return StepResult(observation=reply)
        return StepResult(observation="", reward=self.verify(), done=True)

    def verify(self) -> float:
        result = self.sandbox.run(self.task.verifier)
        self.transcript.append(result)
        return 1.0 if result.exit_code == 0 and not result.timed_out else 0.0

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

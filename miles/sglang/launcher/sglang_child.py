"""Run SGLang's HTTP server (`python -m sglang.launch_server ARGS`) in this process, and end its whole
process group once the process that started it is gone.

miles starts this file with SGLang's own python (a venv of its own, scripts/install-sglang.sh), as the
leader of a new process group (miles/sglang/server.py). A Ray actor that is killed (ray.kill, a dead
node's worker) cannot stop its children; SGLang's scheduler and detokenizer processes would keep the
port and gigabytes of memory. So a thread here watches the parent named by MILES_PARENT_PID and, once
this process has been handed to another parent, SIGKILLs the group: SGLang and every process it spawned.

Only the standard library is imported here (miles is not installed in SGLang's venv), and the file sits
alone in its directory, which Python puts first on sys.path when it runs a file.
"""

import os
import runpy
import signal
import sys
import threading
import time


def watch_parent(parent: int, every_s: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> None:
    parent = os.environ.get("MILES_PARENT_PID", "")
    if parent.isdigit():
        threading.Thread(target=watch_parent, args=(int(parent),), name="miles-exit-with-parent",
                         daemon=True).start()
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

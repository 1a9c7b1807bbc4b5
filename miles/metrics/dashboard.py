"""The live dashboard: one page with the run's plots and latest figures, refreshed as steps land.

Served by the driver while a run goes on (metrics.dashboard = true) or by `miles report RUN_DIR
--serve PORT` for any run directory. It reads metrics.jsonl like `miles report` does and draws the
same PNGs, redrawn only when the file changes. Standard-library HTTP server in a daemon thread:
nothing here may slow down or crash the run, so a failed drawing answers 500 and the page retries.
Non-goals: authentication (it binds to loopback by default) and interactive charts.

    GET /                   the page (polls /api/status every 2 s)
    GET /api/status         {"run", "step", "total_steps", "latest": {...}, "version"}
    GET /plots/<name>.png   one of plots.PLOTS
"""

from __future__ import annotations

import html
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from miles.metrics.plots import PLOTS, render_png
from miles.metrics.run_data import load_run
from miles.metrics.sink import read_metrics
from miles.net import LOOPBACK, ServerThread, bind, url_of

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>miles · {run}</title>
<style>
 body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
 h1 {{ font-size: 1.3em; margin: 0 0 .3em; }}
 #status {{ color: #555; margin-bottom: 1em; }}
 #figures td {{ padding: 2px 12px 2px 0; font-variant-numeric: tabular-nums; }}
 .plots {{ display: flex; flex-wrap: wrap; gap: 12px; margin-top: 1em; }}
 .plots img {{ max-width: 100%; border: 1px solid #ddd; }}
</style></head>
<body>
<h1>miles run <code>{run}</code></h1>
<div id="status">waiting for the first step…</div>
<table id="figures"></table>
<div class="plots">
{images}
</div>
<script>
const SHOWN = {shown};
let version = null;
function fmt(v) {{ return (typeof v === "number") ? (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) : String(v); }}
async function poll() {{
  try {{
    const r = await fetch("api/status", {{cache: "no-store"}});
    if (!r.ok) throw new Error("status " + r.status);
    const s = await r.json();
    const total = s.total_steps === null ? "?" : s.total_steps;
    document.getElementById("status").textContent =
      "step " + s.step + " of " + total + (s.total_steps !== null && s.step >= s.total_steps ? " (finished)" : "");
    document.getElementById("status").dataset.step = s.step;
    const rows = SHOWN.filter(k => k in s.latest).map(k =>
      "<tr><td>" + k + "</td><td>" + fmt(s.latest[k]) + "</td></tr>");
    document.getElementById("figures").innerHTML = rows.join("");
    if (s.version !== version) {{
      version = s.version;
      for (const img of document.querySelectorAll("img[data-plot]")) {{
        img.src = "plots/" + img.dataset.plot + ".png?v=" + encodeURIComponent(version);
      }}
    }}
  }} catch (e) {{
    document.getElementById("status").textContent = "dashboard unreachable (" + e.message + "); retrying";
  }}
}}
for (const img of document.querySelectorAll("img[data-plot]")) {{
  img.addEventListener("load", () => {{ img.dataset.loaded = img.naturalWidth > 0 ? "yes" : "empty"; }});
  img.addEventListener("error", () => {{ img.dataset.loaded = "error"; }});
}}
poll();
setInterval(poll, 2000);
</script>
</body></html>
"""

SHOWN = ["rollout/reward_mean", "eval/accuracy", "rollout/samples_per_s", "perf/goodput_tokens_per_s",
         "perf/step_s", "perf/trainer_idle_frac", "perf/engine_idle_frac", "train/loss", "train/grad_norm",
         "sync/total_s"]


class Dashboard:
    """The dashboard of one run directory; `start()` serves it on a daemon thread, `stop()` ends it."""

    def __init__(self, run_dir: str | Path, host: str = LOOPBACK, port: int = 0):
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port
        self._http: ServerThread | None = None
        self._draw_lock = threading.Lock()
        self._cache: dict[str, tuple[str, bytes]] = {}
        self._url = ""

    @property
    def url(self) -> str:
        """The page's address; known (with the port picked for port 0) once started."""
        return self._url

    def start(self) -> "Dashboard":
        try:
            sock = bind(self.host, self.port)
        except OSError as e:
            raise OSError(f"dashboard cannot listen on {self.host}:{self.port} ({e}); choose another "
                          f"metrics.dashboard_port or 0 for any free port") from None
        # The server takes the socket bound above (IPv6 too) instead of binding its own.
        server = ThreadingHTTPServer(sock.getsockname()[:2], _handler_for(self), bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.server_activate()
        server.daemon_threads = True
        self.port = sock.getsockname()[1]

        def shutdown() -> None:
            server.shutdown()  # returns once serve_forever has
            server.server_close()

        self._http = ServerThread(url_of(sock, self.host), server.serve_forever, shutdown, name="miles dashboard")
        self._url = self._http.url + "/"
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None

    # -- content --------------------------------------------------------------------------------
    def version(self) -> str:
        """Changes whenever metrics.jsonl does (size and mtime), so plots are redrawn only then."""
        try:
            st = (self.run_dir / "metrics.jsonl").stat()
        except FileNotFoundError:
            return "none"
        return f"{st.st_size}-{st.st_mtime_ns}"

    def page(self) -> bytes:
        images = "\n".join(f'<img data-plot="{p}" alt="{p} plot">' for p in PLOTS)
        return PAGE.format(run=html.escape(self.run_dir.name), images=images, shown=json.dumps(SHOWN)).encode()

    def status(self) -> dict:
        version = self.version()
        try:
            records = read_metrics(self.run_dir / "metrics.jsonl")
        except ValueError:
            records = []
        latest: dict = {}
        for r in records:  # the latest value of each key (eval lands only every few steps)
            latest.update({k: v for k, v in r.items() if v is not None})
        total = None
        try:
            total = json.loads((self.run_dir / "config.json").read_text())["loop"]["num_steps"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        step = max((r["step"] for r in records), default=0)
        return {"run": self.run_dir.name, "step": step, "total_steps": total, "latest": latest, "version": version}

    def plot(self, name: str) -> bytes:
        version = self.version()
        hit = self._cache.get(name)
        if hit and hit[0] == version:
            return hit[1]
        # One drawing at a time: matplotlib is CPU-heavy and the run shares these cores.
        with self._draw_lock:
            hit = self._cache.get(name)
            if hit and hit[0] == version:
                return hit[1]
            png = render_png(name, [load_run(self.run_dir)])
            self._cache[name] = (version, png)
            return png


def _handler_for(dash: Dashboard):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", dash.page())
                elif path == "/api/status":
                    self._send(200, "application/json", json.dumps(dash.status()).encode())
                elif path.startswith("/plots/") and path.endswith(".png") and path[7:-4] in PLOTS:
                    self._send(200, "image/png", dash.plot(path[7:-4]))
                else:
                    self._send(404, "text/plain", f"no such page {path}; try / or /api/status".encode())
            except Exception as e:  # a drawing that fails must not take the run down with it
                self._send(500, "text/plain", f"{type(e).__name__}: {e}".encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep the run's console for progress, not access logs
            pass

    return Handler

"""AdapterSync: the trainer's end of `trainer.lora.sync = "adapter"`: only the LoRA adapter travels.

    connect(urls) once -> push(adapter tensors, version) per update -> close()

A push writes the adapter as PEFT writes it (trainer/lora.py `save_adapter`) into
`trainer.lora.adapter_dir/v<version>`, then, with every engine paused in place, loads it on every
engine through SGLang's `/load_lora_adapter {lora_name, lora_path}` under a name of its own
(`policy-v<version>-<run token>`) and labels the weights `<version>` (`/update_weight_version`),
then continues them and unloads every earlier `policy-v*` adapter. The base weights never move.

Which adapter generation uses: miles' requests name none, and a built-in engine serves a request
that names none with the most recently loaded adapter (the `lora_default` extension). A plain SGLang
server would serve them with the base model, so connect refuses engines that do not advertise it,
naming `lora.sync = "merged"` (which works over SGLang's own routes).
All or nothing: if any engine refuses the load, the adapter is unloaded from the engines that took
it (their default falls back to the previous version's adapter) and the push fails with every
engine's reason. Non-goals: verification by checksum (each engine checks the adapter's shapes
against its model on load), transports (the engines read the directory themselves).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid

from miles.engine_api.client import EngineClient
from miles.sync.transports.base import TransportError, engine_client
from miles.trainer.lora import LoraConfig, save_adapter

log = logging.getLogger(__name__)

NAME_PREFIX = "policy-v"
EXTENSION = "lora_default"


class AdapterSync:
    def __init__(self, lora: LoraConfig, admin_token: str | None = None, base_path: str = "",
                 timeout_s: float = 120.0):
        self.lora, self.admin_token, self.base_path, self.timeout_s = lora, admin_token, base_path, timeout_s
        self.root = lora.adapter_dir or tempfile.mkdtemp(prefix="miles-adapters-")
        self.token = uuid.uuid4().hex[:8]  # names of this run's adapters cannot collide with an earlier run's
        self.engine_urls: list[str] = []
        self._client: EngineClient | None = None
        self.current: tuple[str, str] | None = None  # (name, directory) of the adapter in force
        self.needs_start_check = False  # nothing to noise-check: the base weights never travel

    def connect(self, engine_urls: list[str]) -> None:
        urls = [u.rstrip("/") for u in engine_urls]
        if self._client is not None:
            self._client.close()
        self._client = engine_client(self.admin_token, self.timeout_s)
        if EXTENSION not in self._client.extensions(urls):
            raise TransportError(
                f"trainer.lora.sync = 'adapter' needs the miles extension {EXTENSION!r} on every engine (requests "
                f"that name no adapter use the latest loaded one), and not every engine of {urls} advertises it: a "
                "plain SGLang server, or a built-in engine started with sglang_only, serves such requests with the "
                "base model. Use trainer.lora.sync = 'merged', which pushes merged weights over SGLang's routes")
        self.engine_urls = urls

    def relabel(self, version: int) -> None:
        self._client.post_all(self.engine_urls, "/update_weight_version", {"new_version": str(version)})

    def push(self, named, version: int) -> dict[str, float]:
        """Write the adapter of `version` and load it on every engine (see the module docstring)."""
        if self._client is None:
            raise RuntimeError("push before connect: the trainer has no route to the engines")
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"v{version}")
        n_bytes = save_adapter(named, self.lora, path, self.base_path)
        write_s = time.perf_counter() - t0
        name = f"{NAME_PREFIX}{version}-{self.token}"
        self._load_everywhere(self.engine_urls, name, path, version)
        previous, self.current = self.current, (name, path)
        self._unload_others(self.engine_urls, keep=name)
        if previous is not None and previous[1] != path:
            shutil.rmtree(previous[1], ignore_errors=True)  # the engines hold it in memory; it is not read again
        return {"sync/bytes": n_bytes, "sync/adapter_write_s": write_s, "sync/total_s": time.perf_counter() - t0}

    def push_current(self, engine_urls: list[str], version: int) -> dict[str, float]:
        """Bring new engines (launched from the base checkpoint) to the adapter in force."""
        if self.current is None:
            return {}
        t0 = time.perf_counter()
        urls = [u.rstrip("/") for u in engine_urls]
        self._load_everywhere(urls, *self.current, version)
        self._unload_others(urls, keep=self.current[0])
        return {"sync/total_s": time.perf_counter() - t0}

    def _load_everywhere(self, urls: list[str], name: str, path: str, version: int) -> None:
        # Paused in place from the load to the label, so no token is generated by the new adapter under
        # the old version's label; requests keep their KV and continue on the new adapter.
        paused = self._pause(urls)
        try:
            results = self._client.try_all(urls, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
            failed = [f"{u}: {r}" for u, r in zip(urls, results) if isinstance(r, Exception)]
            if failed:
                took = [u for u, r in zip(urls, results) if not isinstance(r, Exception)]
                self._client.try_all(took, "/unload_lora_adapter", {"lora_name": name})
                raise TransportError(f"LoRA adapter version {version} ({path}) was refused, so no engine serves "
                                     f"it (each stays on its previous adapter): {'; '.join(failed)}")
            self._client.post_all(urls, "/update_weight_version", {"new_version": str(version)})
        finally:
            if paused:
                self._client.post_all(paused, "/continue_generation", {})

    def _pause(self, urls: list[str]) -> list[str]:
        """Pause in place every engine that is generating and not paused by its owner."""
        loads = self._client.post_all(urls, "/get_load", None, method="GET")
        mine = [u for u, load in zip(urls, loads) if not load.get("paused")]
        if mine:
            self._client.post_all(mine, "/pause_generation", {"mode": "in_place"})
        return mine

    def _unload_others(self, urls: list[str], keep: str) -> None:
        """Unload every policy adapter but `keep`: the previous version's, and any an earlier trainer of
        this fleet left (a restart). Failures only cost memory, so they are logged, not raised."""
        for url, info in zip(urls, self._client.post_all(urls, "/get_server_info", None, method="GET")):
            for other in info.get("loaded_lora_adapters") or {}:
                if other.startswith(NAME_PREFIX) and other != keep:
                    try:
                        self._client.post(url, "/unload_lora_adapter", {"lora_name": other})
                    except TransportError as exc:
                        log.warning("could not unload the earlier adapter %s (%s)", other, exc)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

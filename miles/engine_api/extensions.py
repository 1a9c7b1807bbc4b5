"""The miles extensions to SGLang's protocol: what each adds, and how a client learns which it may use.

An engine speaking the contract in miles mode lists the extensions it offers in its
/get_server_info as `miles_extensions` (the built-in engine: BASE_EXTENSIONS plus one per weight
transport whose Receiver it mounted, sync/transports/<name>.py). A plain SGLang server, or a
built-in engine in SGLang-only mode, has no such key: no extensions. A client uses an extension only
where every engine it talks to advertises it (`common`), and otherwise falls back to SGLang's own
routes and fields (docs/sglang.md; tests/e2e/test_sglang_conformance.py holds miles to
EXTENSION_SURFACE).
Non-goal: serving the extensions (the built-in engine's weight_api.py and server.py).
"""

from __future__ import annotations

from collections.abc import Iterable

# The key of /get_server_info that lists an engine's miles extensions.
SERVER_INFO_KEY = "miles_extensions"

# The miles extensions every built-in engine in miles mode has, besides its transports' (their
# Receivers' `extension`).
# lora_default: a /generate request that names no adapter (lora_path) uses the most recently loaded
# one, where SGLang uses the base model (engine/lora.py); it adds no route or field.
# device_digest: checksums of weights on a GPU computed there (sync/verify.py's sum64), not on the host.
BASE_EXTENSIONS = ("staged_commit", "flattened_small", "checked_weights", "engine_load", "lora_default",
                   "device_digest")

# What each extension adds to SGLang's protocol: a route of its own (None) or fields on an SGLang
# route. A client may send these only to an engine that advertises the extension. Load-format values
# ("flattened_small", "shm", "miles_delta") ride on SGLang's string `load_format` field.
EXTENSION_SURFACE: dict[str, dict[str, frozenset[str] | None]] = {
    "staged_commit": {"/update_weights_from_distributed": frozenset({"commit", "reset_staging"}),
                      "/update_weights_from_disk": frozenset({"commit", "reset_staging"}),
                      "/update_weights_from_tensor": frozenset({"commit", "reset_staging", "swap_buffers"})},
    "flattened_small": {"/update_weights_from_distributed": frozenset({"screened"})},
    "checked_weights": {"/weights_checker": frozenset({"seed", "expected", "buckets"})},
    "device_digest": {"/weights_checker": frozenset({"digest"})},
    "engine_load": {"/get_load": None, "/get_weight_version": None},
    "p2p": {"/p2p_open_buffer": None, "/p2p_close_buffer": None,
            "/update_weights_from_tensor": frozenset({"screened"})},
    "colocated": {"/update_weights_from_tensor": frozenset({"shm_path", "names", "dtypes", "shapes", "offsets"})},
    "disk_delta": {"/init_delta_base": None},
    "lora_default": {},
    # A weight the engine serves in a format may be sent as that format's bytes, under the name
    # "<name>@<format>" (precision/wire.py); /get_server_info lists them as `quantized_weights`.
    "quantized_weights": {},
}


def advertised(server_info: dict) -> frozenset[str]:
    """The extensions one engine's /get_server_info lists (none for a plain SGLang server)."""
    mine = server_info.get(SERVER_INFO_KEY)
    return frozenset(mine) if isinstance(mine, list) else frozenset()


def common(server_infos: Iterable[dict]) -> frozenset[str]:
    """The extensions every engine offers, given each one's /get_server_info: what a client may use."""
    offered = None
    for info in server_infos:
        mine = advertised(info)
        offered = mine if offered is None else offered & mine
    return offered or frozenset()

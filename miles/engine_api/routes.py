"""The routes of the engine contract that miles' own components call, by name.

An engine speaking the contract serves SGLang's HTTP API (the built-in engine, an SGLang server, or
a router in front of either); miles' extensions add routes and fields (extensions.py). These are the
paths the rest of miles calls through EngineClient; the weight routes each transport uses are in its
own module (sync/transports/), the routes a router adds for its workers at the end.
Non-goal: serving them (engine/server.py, rollout/router/app.py).
"""

from __future__ import annotations

# Generation.
GENERATE = "/generate"
ABORT_REQUEST = "/abort_request"

# Probes: /health answers while the server runs; /health_generate only once a token was generated
# (a stalled or wedged engine answers neither, a full batch delays only the second).
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
GET_MODEL_INFO = "/get_model_info"  # weight_version (a string), tokenizer_path
GET_SERVER_INFO = "/get_server_info"  # miles_extensions

# Admin (need the admin token where the engine has one).
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
RELEASE_MEMORY = "/release_memory_occupation"
RESUME_MEMORY = "/resume_memory_occupation"

# A router's own routes for the engines behind it.
ADD_WORKER = "/add_worker"
REMOVE_WORKER = "/remove_worker"
LIST_WORKERS = "/list_workers"

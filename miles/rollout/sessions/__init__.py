"""Sessions: an OpenAI-compatible chat endpoint per session, so black-box agent harnesses can drive
rollouts while miles records the exact tokens underneath.

A harness written against the `openai` client is pointed at `<server>/sessions/<id>/v1` and talks
chat messages, with tools if it likes:
  - the first request's messages (and its `tools`, which the chat template lists for the model) go
    through the chat template once and are tokenized once;
  - every later request must repeat the conversation so far (including the assistant replies it
    was given, tool calls included, unchanged) and may append new messages (`role: "tool"` results,
    user turns); only that appended suffix is rendered (ChatFormat.suffix_ids) and tokenized, and
    the engine's output ids are kept as returned. Nothing is ever re-rendered, so a template that
    rewrites history (Qwen3 drops earlier <think> blocks) cannot make the recorded ids drift.
A request that rewrites history is refused with 400 rather than silently re-tokenized. The model's
text is split into `content` and `tool_calls` by a parser chosen per model family (engine_api/tool_calls.py);
`finish_reason` is "tool_calls" when it wrote any. The session's trajectory
(`GET /sessions/<id>/trajectory`, or `Session.to_sample()`) has loss mask 1 on model tokens, 0 on
the rest, one logprob per model token and one weight version per model turn. A session made for a
training run (`miles train` with rollout.generate_fn = "harness") has an API key, a turn and token
budget, and samples under the run's temperature/top_p/top_k whatever the request asks, because the
trainer's logprobs assume them.

    server.py           the HTTP routes, start_session_server, `miles sessions`
    store.py            Session, SessionStore: the exact-token bookkeeping of each conversation

One chat turn as the engine API defines it (request parsing, the first rendering, OpenAI bodies and
stream chunks, the request schema, the tool-call parsers) lives in engine_api/ (chat_completion.py,
chat_schema.py, tool_calls.py), shared with the built-in engine's stateless /v1/chat/completions.

This package's modules import FastAPI and httpx; nothing is imported here, so reading the tool-parser
registry (run config checks) stays light. Non-goals: n > 1 (refused: one session is one trajectory),
constrained decoding (`tool_choice = "required"` or a named function does not force a call), the
legacy /v1/completions route.
"""

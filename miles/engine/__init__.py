"""The built-in rollout engine: an HF model behind a continuous-batching scheduler and an
SGLang-compatible HTTP API. Import the pieces from their modules (config, engine, server); this
package stays import-light so `miles --help` is instant."""

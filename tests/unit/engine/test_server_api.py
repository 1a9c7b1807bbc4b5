"""Read-only endpoints of the engine's SGLang-compatible API."""

from __future__ import annotations


def test_health_endpoints(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_model_and_server_info(client, model_dir):
    info = client.get("/get_model_info").json()
    assert info == {"model_path": model_dir, "tokenizer_path": model_dir, "served_model_name": model_dir,
                    "is_generation": True, "weight_version": "default"}  # SGLang's first version
    server = client.get("/get_server_info").json()
    assert server["model_path"] == model_dir
    assert server["max_batch_size"] == 256 and server["dtype"] == "float32"
    assert server["context_length"] == 512
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    assert "staged_commit" in server["miles_extensions"] and "p2p" in server["miles_extensions"]


def test_generate_response_shape(client):
    r = client.post("/generate", json={"input_ids": [5, 6, 7], "rid": "abc", "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "abc" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]  # SGLang's spans
    assert [len(x) for x in meta["output_token_logprobs"]] == [3, 3, 3]
    assert all(x[2] is None and x[0] <= 0 for x in meta["output_token_logprobs"])
    plain = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    assert "output_token_logprobs" not in plain.json()["meta_info"]

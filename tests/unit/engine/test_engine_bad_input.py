"""Nothing a client sends crashes the engine: bad requests get 400 naming the field; admin is guarded."""

from __future__ import annotations

import pytest

OK = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}

BAD_BODIES = [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}', "NaN"),
    (b'{"input_ids": [5], "sampling_params": {"top_p": Infinity}}', "Infinity"),
    (b"", "expected a JSON object"),
]

BAD_JSON = [
    ({"input_ids": [5], "bogus": 1}, "bogus"),
    ({"input_ids": [5], "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"input_ids": "5 6 7"}, "input_ids"),
    ({"input_ids": [5, "6"]}, "input_ids"),
    ({"input_ids": [5, 6.0]}, "input_ids"),
    ({"input_ids": [[5], 6]}, "input_ids[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"text": ""}, "prompt is empty"),
    ({"input_ids": [5], "text": "hi"}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": [10**9]}, "outside the vocabulary"),
    ({"input_ids": [5] * 600}, "context length"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 10**12}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ({"input_ids": [5], "sampling_params": {"temperature": True}}, "sampling_params.temperature"),
    ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [5], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [5], "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"input_ids": [5], "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"input_ids": [5], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"input_ids": [5], "sampling_params": {"stop_token_ids": [10**9]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [5], "sampling_params": {"sampling_seed": -3}}, "sampling_params.sampling_seed"),
    ({"input_ids": [5], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [5], "sampling_params": [1]}, "sampling_params"),
    ({"input_ids": [[5], [6]], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    ({"input_ids": [5], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [5], "rid": 12}, "rid"),
    ({"input_ids": [[5], [6]], "stream": True}, "stream"),
    ({"input_ids": [5], "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("raw,reason", BAD_BODIES)
def test_unparseable_bodies_get_400(client, raw, reason):
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]


@pytest.mark.parametrize("body,reason", BAD_JSON)
def test_invalid_requests_get_400_naming_the_field(client, body, reason):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]


def test_engine_keeps_serving_after_bad_requests(client):
    for body, _ in BAD_JSON[:8]:
        client.post("/generate", json=body)
    r = client.post("/generate", json=OK)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert client.get("/health_generate").status_code == 200


def test_bad_item_rejects_the_whole_batch_before_any_runs(client):
    before = client.get("/get_server_info").json()["engine_stats"]["prefill_forwards"]
    r = client.post("/generate", json={"input_ids": [[5, 6], [10**9]], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400
    assert client.get("/get_server_info").json()["engine_stats"]["prefill_forwards"] == before


@pytest.mark.parametrize("path,body", [
    ("/flush_cache", {}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2}),
    ("/update_weights_from_distributed", {"names": [], "commit": True}),
])
def test_admin_endpoints_need_the_token(client, path, body):
    assert client.post(path, json=body).status_code == 401
    assert client.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/get_weight_version").json()["weight_version"] == "default"


def test_flush_cache_with_token(client, admin_token):
    r = client.post("/flush_cache", headers={"Authorization": f"Bearer {admin_token}"})
    assert r.status_code == 200 and r.json()["success"] is True


def test_server_info_never_shows_the_admin_token(client, admin_token):
    r = client.get("/get_server_info")
    assert r.status_code == 200
    assert admin_token not in r.text
    assert r.json()["admin_token_set"] is True

"""`miles serve` and `miles router` read their flags through the run config's dotted-key loader:
the documented flags keep working in both `--port P` and `--port=P` forms, every config key is a
flag, and a bad value is refused with the key's name."""

from __future__ import annotations

import pytest

from miles.rollout.engine.server import parse_args as serve_args
from miles.rollout.router.app import parse_args as router_args


def test_serve_takes_the_readme_flags_and_any_engine_key():
    cfg, log_level = serve_args(["--model", "/m", "--port", "30001", "--host=0.0.0.0", "--admin-token", "t",
                                 "--max-batch-size", "4", "--prefix_cache_mb=8", "--no-reuse-weight-memory",
                                 "--log-level", "info"])
    assert (cfg.model_path, cfg.port, cfg.host, cfg.admin_token) == ("/m", 30001, "0.0.0.0", "t")
    assert (cfg.max_batch_size, cfg.prefix_cache_mb, cfg.reuse_weight_memory, log_level) == (4, 8.0, False, "info")
    cfg, _ = serve_args(["--model=/m", "--port=0", "--no-prefix-cache"])
    assert cfg.port == 0 and not cfg.prefix_cache


def test_serve_refuses_a_missing_model_and_a_bad_value(capsys):
    with pytest.raises(SystemExit) as e:
        serve_args(["--port", "1"])
    assert e.value.code == 2 and "--model DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        serve_args(["--model", "/m", "--max-batch-size", "many"])
    assert e.value.code == 2 and "max_batch_size" in capsys.readouterr().err


def test_router_takes_its_flags_as_router_and_health_keys():
    cfg = router_args(["--port", "0", "--worker-urls", "http://a:1", "http://b:2", "--admin-token=x",
                       "--health-check-interval-s", "0.2", "--failure-threshold", "3", "--router.max_retries", "1"])
    assert (cfg.router.port, cfg.router.admin_token, cfg.router.max_retries) == (0, "x", 1)
    assert cfg.worker_urls == ["http://a:1", "http://b:2"]
    assert (cfg.health.interval_s, cfg.health.failure_threshold) == (0.2, 3)
    assert router_args(["--host", "0.0.0.0"]).router.port == 30000  # the router's own default port


def test_router_refuses_a_url_that_is_not_one(capsys):
    with pytest.raises(SystemExit) as e:
        router_args(["--worker-urls", "10.0.0.5:30000"])
    assert e.value.code == 2 and "http://host:port" in capsys.readouterr().err

"""`miles serve` and `miles router` read their flags through the run config's dotted-key loader:
the documented flags keep working in both `--port P` and `--port=P` forms, every config key is a
flag, and a bad value is refused with the key's name."""

from __future__ import annotations

import pytest

from miles.engine.server import parse_args as serve_args
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
    assert router_args(["--host", "0.0.0.0", "--admin-token", "t"]).router.port == 30000  # the router's own default


def test_router_refuses_a_url_that_is_not_one(capsys):
    with pytest.raises(SystemExit) as e:
        router_args(["--worker-urls", "10.0.0.5:30000"])
    assert e.value.code == 2 and "http://host:port" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node7"])
def test_without_a_token_serve_and_router_refuse_a_host_other_than_loopback(capsys, host):
    for parse, argv in ((serve_args, ["--model", "/m", "--host", host]), (router_args, ["--host", host])):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--admin-token" in err and "--insecure-admin" in err, err
    # The token, or an explicit --insecure-admin, lets them bind it; loopback never needs either.
    assert serve_args(["--model", "/m", "--host", host, "--admin-token", "t"])[0].host == host
    assert serve_args(["--model", "/m", "--host", host, "--insecure-admin"])[0].insecure_admin
    assert router_args(["--host", host, "--insecure-admin"]).router.insecure_admin
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert serve_args(["--model", "/m", "--host", loopback])[0].admin_token is None
        assert router_args(["--host", loopback]).router.admin_token is None


def test_a_router_started_in_process_without_a_token_refuses_a_public_host():
    from miles.config import ConfigError
    from miles.rollout.router import RouterConfig, start_router_thread

    with pytest.raises(ConfigError, match="admin token"):
        start_router_thread(RouterConfig(host="0.0.0.0"), [])

"""The CPU adapter over megatron-core is pinned: every line it stands in for is still where it says in
the installed release, and any other release is refused with the way out."""

from __future__ import annotations

import importlib
import inspect

import pytest

from miles.trainer.backends.megatron import cpu_adapter
from miles.trainer.backends.megatron.cpu_adapter import (
    CPU_TORCH_MODULES, DISPATCH_SPLITS_SITE, NORM_SITE, PINNED, RNG_SITE, RNG_TRACKER_SITE, ROPE_CP_SITE, TE_GEMM_SITE,
    TIED_EMBEDDING_SITE, AdapterError)

SITES = CPU_TORCH_MODULES + (RNG_SITE, RNG_TRACKER_SITE, TE_GEMM_SITE, DISPATCH_SPLITS_SITE, NORM_SITE, TIED_EMBEDDING_SITE,
                             ROPE_CP_SITE)


def test_the_installed_megatron_core_is_the_pinned_one():
    assert cpu_adapter.installed_version() == PINNED


@pytest.mark.parametrize("site", SITES, ids=lambda s: f"{s.module.removeprefix('megatron.core.')}:{s.lines[0]}")
def test_each_patched_line_is_still_where_the_adapter_names_it(site):
    lines = inspect.getsource(importlib.import_module(site.module)).splitlines()
    cuda = ("cuda", "te_general_gemm", "sequence_parallel", "maybe_move_tensor_to_cpu", "pin_memory")
    for n in site.lines:
        assert any(word in lines[n - 1] for word in cuda), f"{site.module} line {n}: {lines[n - 1]!r}"
    assert any(site.source in lines[n - 1] for n in site.lines), f"{site.source!r} not on {site.module} {site.lines}"


def test_another_release_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(cpu_adapter, "installed_version", lambda: "0.17.0")
    with pytest.raises(AdapterError, match=r"written against megatron-core 0.16.1, but 0.17.0 is installed: "
                                           r"install megatron-core==0.16.1"):
        cpu_adapter.check_version()

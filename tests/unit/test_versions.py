"""Weight versions: strings on the wire (SGLang's type), policy versions inside miles."""

from __future__ import annotations

import pytest

from miles.rollout.generate import versions_of
from miles.versions import INITIAL, from_wire, to_wire


def test_wire_strings_map_to_policy_versions():
    assert to_wire(12) == "12" and from_wire(to_wire(12)) == 12
    # SGLang starts at "default"; a label this run never sent stands for the starting weights.
    assert from_wire(INITIAL) == 0 and from_wire("v7") == 0 and from_wire(None) == 0
    assert from_wire(3) == 3  # a server from before string versions
    with pytest.raises(ValueError, match="non-negative integer"):
        to_wire(-1)


def test_a_reply_written_by_two_versions_reports_both_in_order():
    meta = {"weight_version": "4", "weight_versions": [{"version": "3", "start": 0, "end": 5},
                                                       {"version": "4", "start": 5, "end": 9}]}
    assert versions_of(meta) == [3, 4]
    assert versions_of({"weight_version": "default"}) == [0]  # SGLang's first evaluation must not crash

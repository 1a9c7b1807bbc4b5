"""Preparation: fixed-size buckets, dtype conversion, commit only after the last bucket."""

import torch

from miles.sync.prepare import buckets, push_weights


class RecordingTransport:
    """Stands in for the wire: records what the preparation pipeline hands over, in order."""

    def __init__(self):
        self.events = []

    def send_bucket(self, bucket):
        self.events.append(("bucket", [(n, t.dtype, tuple(t.shape)) for n, t in bucket]))

    def commit(self, version):
        self.events.append(("commit", version))


def named(sizes):
    return [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_never_exceed_the_size_unless_one_tensor_is_larger():
    out = list(buckets(named([100, 100, 100, 500, 10]), bucket_bytes=800))
    assert [[n for n, _ in b] for b in out] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    for b in out:
        size = sum(t.numel() * 4 for _, t in b)
        assert size <= 800 or len(b) == 1


def test_push_sends_every_tensor_once_then_commits_the_version():
    tr = RecordingTransport()
    stats = push_weights(iter(named([64, 64, 64])), tr, version=3, bucket_bytes=300, dtype="bfloat16")
    sent = [n for kind, b in tr.events if kind == "bucket" for n, _, _ in b]
    assert sent == ["w0", "w1", "w2"]
    assert all(dt == torch.bfloat16 for kind, b in tr.events if kind == "bucket" for _, dt, _ in b)
    assert tr.events[-1] == ("commit", 3) and sum(1 for e in tr.events if e[0] == "commit") == 1
    assert stats["sync/buckets"] == 2 and stats["sync/bytes"] == 3 * 64 * 2

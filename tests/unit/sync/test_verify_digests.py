"""sum64, the digest of weights checked where they are (miles/sync/verify.py): equal for equal bytes however
they are split into passes, different for any changed or swapped 64-bit word."""

from __future__ import annotations

import pytest
import torch

from miles.sync import verify


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(37, 11, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),
            torch.randint(0, 9, (3, 3), generator=g, dtype=torch.int32)]


def test_equal_bytes_give_equal_digests_whatever_the_pass_size(weights, monkeypatch):
    whole = verify.bucket_checksum(weights, "sum64")
    assert whole == verify.bucket_checksum([w.clone() for w in weights], "sum64")
    monkeypatch.setattr(verify, "_CHUNK", 7)  # many passes per tensor, the last one short
    assert verify.bucket_checksum(weights, "sum64") == whole
    assert len(whole) == 32 and int(whole, 16) >= 0


def test_any_changed_bit_or_swapped_word_changes_the_digest(weights):
    whole = verify.bucket_checksum(weights, "sum64")
    flipped = [w.clone() for w in weights]
    flipped[0].view(torch.int32)[5, 3] ^= 1 << 17
    assert verify.bucket_checksum(flipped, "sum64") != whole
    swapped = [w.clone() for w in weights]
    words = swapped[0].view(-1)[:400].view(torch.int64)  # a view into the tensor, as 64-bit words
    words[[2, 9]] = words[[9, 2]].clone()
    assert not torch.equal(swapped[0], weights[0])
    assert verify.bucket_checksum(swapped, "sum64") != whole
    assert verify.bucket_checksum(weights[::-1], "sum64") != whole  # the order of tensors counts


def test_a_tensor_digest_is_its_bucket_of_one(weights):
    assert verify.tensor_checksum(weights[1], "sum64") == verify.bucket_checksum([weights[1]], "sum64")
    assert verify.tensor_checksum(weights[1]) == verify.bucket_checksum([weights[1]])  # xxh3 stays the default


@pytest.mark.cuda
def test_the_digest_on_a_gpu_equals_the_digest_on_the_host(weights):
    assert verify.bucket_checksum([w.cuda() for w in weights], "sum64") == verify.bucket_checksum(weights, "sum64")

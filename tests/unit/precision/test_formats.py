"""Every format against hand-worked values and its spec's edge cases, and a round-trip bound on random tensors."""

import math

import pytest
import torch

from miles.precision.formats import (FORMATS, dequantize, e2m1_codes, e2m1_values, fake_quantize, get_format,
                                     pack_nibbles, quantize, to_e4m3, to_e5m2, unpack_nibbles)

NAN, INF = float("nan"), float("inf")


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


# ---- element conversions ---------------------------------------------------------------------

def test_e4m3_rounds_ties_to_even_saturates_and_keeps_subnormals():
    x = torch.tensor([0.0, 448, 464, 500, 1e6, INF, -INF, 2**-9, 2**-10, 3 * 2**-10, 7 * 2**-9, 2**-6,
                      1 + 1 / 16, 1 + 3 / 16, -0.0])
    assert bits(to_e4m3(x)) == [0x00, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE,
                                0x01,  # smallest subnormal 2^-9
                                0x00,  # half of it: a tie between 0 and 0x01, to the even 0
                                0x02,  # 1.5 × it: a tie between 0x01 and 0x02, to the even 0x02
                                0x07,  # largest subnormal
                                0x08,  # smallest normal
                                0x38,  # 1 + 1/16 ties to 1.0 (even mantissa) rather than 1.125
                                0x3A,  # 1 + 3/16 ties to 1.25 rather than 1.125
                                0x80]  # -0 keeps its sign
    assert torch.isnan(to_e4m3(torch.tensor([NAN])).float()).all()


def test_e5m2_saturates_where_torch_alone_overflows_to_inf():
    assert bits(torch.tensor([61440.0]).to(torch.float8_e5m2)) == [0x7C]  # torch's plain cast: +Inf
    x = torch.tensor([57344.0, 61440, 1e9, INF, -INF, 2**-16, 2**-17, 3 * 2**-17, 1 + 1 / 8, 1 + 3 / 8])
    assert bits(to_e5m2(x)) == [0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x01, 0x00, 0x02, 0x3C, 0x3E]
    assert torch.isnan(to_e5m2(torch.tensor([NAN])).float()).all()


def test_e2m1_grid_ties_to_even_saturation_and_packing():
    x = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6,          # every magnitude, codes 0..7
                      0.2, 0.3,                             # below / above half the subnormal 0.5
                      0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5,  # every midpoint, to the even code
                      6.5, 100, INF, -1.5, -INF, -0.0])
    assert e2m1_codes(x).tolist() == [0, 1, 2, 3, 4, 5, 6, 7,
                                      0, 1,
                                      0, 2, 2, 4, 4, 6, 6,
                                      7, 7, 7, 0xB, 0xF, 0x8]
    assert e2m1_values(torch.tensor([0xB, 0x7, 0x1], dtype=torch.uint8)).tolist() == [-1.5, 6.0, 0.5]
    packed = pack_nibbles(torch.tensor([1, 2, 0xF, 0x0], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F]  # the first of each pair sits in the low nibble
    assert unpack_nibbles(packed).tolist() == [1, 2, 0xF, 0x0]


# ---- FP8 with FP32 scales ------------------------------------------------------------------------

def test_fp8_per_tensor_hand_worked():
    q = quantize(torch.tensor([4.0, -1.0, 0.5, 3.0]), "fp8_tensor")
    assert q.scales.dtype == torch.float32 and q.scales.item() == pytest.approx(4 / 448)
    # x / scale = 448, -112, 56, 336; 336 = 1.3125 · 2^8 sits halfway between 320 and 352 and goes to
    # 320, whose mantissa (010) is even.
    assert q.data.dtype == torch.float8_e4m3fn
    assert q.data.float().flatten().tolist() == [448.0, -112.0, 56.0, 320.0]
    assert dequantize(q).tolist() == pytest.approx([4.0, -1.0, 0.5, 320 * 4 / 448], rel=1e-6)


def test_fp8_blocks_are_128_by_128_with_their_own_scale_and_overhang_at_the_edges():
    x = torch.zeros(130, 260)
    x[0, 0], x[5, 127] = 448.0, 1.0          # block (0, 0): amax 448 → scale 1
    x[128, 0] = 2.0                          # block (1, 0): amax 2
    x[129, 259] = -7.0                       # block (1, 2): the 2 × 4 corner that overhangs the tensor
    q = quantize(x, "fp8")
    assert q.data.shape == (130, 260)  # the overhang is not stored
    assert q.scales.shape == (2, 3)
    # all-zero blocks get a unit scale
    assert q.scales.flatten().tolist() == pytest.approx([1.0, 1.0, 1.0, 2 / 448, 1.0, 7 / 448], rel=1e-7)
    assert q.data[128, 0].float() == 448 and q.data[129, 259].float() == -448
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("name", ["fp8_e5m2", "fp8_e5m2_tensor"])
def test_e5m2_scales_use_its_own_range(name):
    q = quantize(torch.tensor([[57344.0, 1.0, -3.0 * 2**-16]]), name)
    assert q.scales.item() == 1.0 and bits(q.data) == [0x7B, 0x3C, 0x83]  # 0x83: −3 · 2^-16, a subnormal


@pytest.mark.parametrize("name", ["fp8", "fp8_tensor", "fp8_e5m2", "fp8_e5m2_tensor", "int4", "int4_asym", "mxfp8"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_other_blocks_alone(name, bad):
    block = FORMATS[name].block or (1, 256)
    x = torch.randn(1, 256)
    x[0, 0] = bad
    out = dequantize(quantize(x, name))
    assert torch.isnan(out[0, :block[1]]).all()
    if FORMATS[name].block is not None:
        assert torch.isfinite(out[0, block[1]:]).all()


# ---- MXFP8 ---------------------------------------------------------------------------------------

def test_mxfp8_scale_is_floor_log2_amax_minus_8_in_e8m0():
    x = torch.zeros(5, 32)
    x[0, 0] = 1.0             # floor(log2 1) - 8 = -8: scale byte 127 - 8 = 119; 1.0 → 256 = 0x78
    x[0, 1] = 2**-17          # → 2^-9, E4M3's smallest subnormal
    x[0, 2] = 2**-18          # → 2^-10, a tie between 0 and 2^-9, to 0
    x[1, 0] = 3.0             # floor(log2 3) = 1: X = 2^-7, 3 → 384, exact
    x[2, 0] = 1.9375          # X = 2^-8: 1.9375 → 496, above 448: saturates, comes back as 1.75
    x[3, 0] = 2**-140         # X would be 2^-148: clamped to E8M0's smallest, 2^-127; 2^-13 rounds to 0
    # row 4: the all-zero block
    q = quantize(x, "mxfp8")
    assert q.scales.dtype == torch.float8_e8m0fnu and q.scales.shape == (5, 1)
    assert bits(q.scales) == [119, 120, 119, 0, 0]
    assert bits(q.data[0, :3]) == [0x78, 0x01, 0x00]
    out = dequantize(q)
    assert out[0, :3].tolist() == [1.0, 2**-17, 0.0]
    assert out[1, 0] == 3.0 and out[2, 0] == 1.75 and out[3, 0] == 0.0
    assert torch.equal(out[4], torch.zeros(32))


def test_mxfp8_nan_scale_is_e8m0s_nan_byte():
    x = torch.ones(2, 32)
    x[1, 3] = INF
    q = quantize(x, "mxfp8")
    assert bits(q.scales) == [127 - 8, 0xFF]
    assert torch.isnan(dequantize(q)[1]).all() and torch.equal(dequantize(q)[0], torch.ones(32))


# ---- NVFP4 ---------------------------------------------------------------------------------------

def test_nvfp4_hand_worked_two_level_scales():
    # Tensor amax 2688 = 448 · 6 makes the FP32 tensor scale exactly 1; block 0's E4M3 scale is then
    # 2688 / 6 = 448 and its elements are multiples of 448.
    b0 = torch.tensor([0, 224, 448, 672, 896, 1344, 1792, 2688,       # every E2M1 magnitude × 448
                       112, 336, 2240, -1344, 0, 0, 0, 0])          # ties → 0, 1.0, 4.0; a negative
    b1 = torch.tensor([12.0, 2, 1, 3] + [0] * 12)                    # amax 12: block scale 2
    b2 = torch.zeros(16)                                             # all zero
    b3 = torch.full((16,), 2.0**-12)                                 # its scale underflows E4M3
    q = quantize(torch.cat([b0, b1, b2, b3]), "nvfp4")
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.item() == 1.0
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.float().flatten().tolist() == [448, 2, 0, 0]
    assert q.data.dtype == torch.float4_e2m1fn_x2 and q.data.shape == (1, 32)
    codes = unpack_nibbles(q.data).flatten().tolist()
    assert codes[:16] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 6, 0xD, 0, 0, 0, 0]
    assert codes[16:20] == [7, 2, 1, 3]  # 12/2 = 6, 1, 0.5 (the subnormal), 1.5
    out = dequantize(q)
    assert out[:12].tolist() == [0, 224, 448, 672, 896, 1344, 1792, 2688, 0, 448, 1792, -1344]
    assert out[16:20].tolist() == [12.0, 2, 1, 3]
    assert torch.equal(out[32:], torch.zeros(32))  # the all-zero block and the flushed one


def test_nvfp4_tensor_scale_maps_the_amax_onto_448_times_6():
    x = torch.randn(4, 64) * 3
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    assert q.scales.float().max().item() == 448.0  # the block holding the amax uses the top scale


def test_nvfp4_a_nan_anywhere_poisons_the_tensor_through_its_scale():
    x = torch.randn(64)
    x[40] = NAN
    assert torch.isnan(dequantize(quantize(x, "nvfp4"))).all()


# ---- INT4 ----------------------------------------------------------------------------------------

def test_int4_symmetric_hand_worked():
    x = torch.zeros(2, 128)
    x[0, :8] = torch.tensor([7.0, -7.0, 3.5, -3.5, 2.5, 0.5, 1.5, -1.0])  # amax 7 → scale 1
    q = quantize(x, "int4")
    assert q.data.dtype == torch.uint8 and q.data.shape == (2, 64)  # two values per byte
    assert q.scales.tolist() == [[1.0], [1.0]]  # row 1 is all zero: unit scale
    # round half to even: 3.5 → 4, -3.5 → -4, 2.5 → 2, 0.5 → 0, 1.5 → 2; -7 = 0x9, -4 = 0xC, -1 = 0xF
    assert q.data[0, :4].tolist() == [0x97, 0xC4, 0x02, 0xF2]
    assert dequantize(q)[0, :8].tolist() == [7, -7, 4, -4, 2, 0, 2, -1]
    assert torch.equal(dequantize(q)[1], torch.zeros(128))


def test_int4_asymmetric_keeps_zero_exact_and_uses_all_16_levels():
    x = torch.zeros(3, 128)
    x[0, :3] = torch.tensor([-1.0, 2.0, 0.0])  # scale 3/15, zero point 5: -1 → 0, 2 → 15, 0 → 5
    x[1, :3] = torch.tensor([1.0, 2.0, 3.0])   # all positive: the range still starts at 0, zero point 0
    q = quantize(x, "int4_asym")
    assert q.zero_points.dtype == torch.uint8 and q.zero_points.flatten().tolist() == [5, 0, 0]
    assert q.scales.flatten().tolist() == pytest.approx([0.2, 0.2, 1.0])
    assert unpack_nibbles(q.data)[0, :4].tolist() == [0, 15, 5, 5]
    out = dequantize(q)
    assert out[0, :3].tolist() == pytest.approx([-1.0, 2.0, 0.0], abs=1e-6) and out[0, 2] == 0.0
    assert out[1, :3].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)
    assert torch.equal(out[2], torch.zeros(128))


# ---- every format --------------------------------------------------------------------------------

def _per_element(q, grid: torch.Tensor, shape) -> torch.Tensor:
    """A per-block tensor (block rows, block cols) spread over the tensor's 2-D view."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    br, bc = q.format.block or (rows, cols)
    return grid.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_round_trip_error_is_within_the_formats_bound(name, magnitude):
    torch.manual_seed(0)
    shape = (3, 70, 150)  # blocks overhang on both sides
    x = torch.randn(shape) * magnitude
    x.view(-1)[::97] *= 50  # a few outliers per block
    q = quantize(x, name)
    out = dequantize(q).reshape(-1, shape[-1])
    x2 = x.reshape(-1, shape[-1])
    err, mag = (out - x2).abs(), x2.abs()
    fmt = FORMATS[name]
    slack = 1e-6 * mag + 1e-30
    if fmt.element in ("e4m3", "e5m2"):
        mant, min_sub, top = (3, 2**-9, 448.0) if fmt.element == "e4m3" else (2, 2**-16, 57344.0)
        unit = _per_element(q, q.scales.float(), shape)
        # Only MXFP8's power-of-two scale lets values exceed the top (amax / 448 rounds by an ulp at most).
        saturated = mag > top * unit * (1 + 1e-6)
        assert (fmt.name == "mxfp8") or not saturated.any()
        assert torch.equal(out[saturated].abs(), (top * unit)[saturated])
        bound = mag * 2.0 ** -(mant + 1) + unit * min_sub / 2 + (mag - top * unit).clamp(min=0) + slack
    elif fmt.element == "e2m1":
        unit = _per_element(q, q.scales.float() * q.tensor_scale, shape)
        bound = 0.25 * mag + 0.25 * unit + (mag - 6 * unit).clamp(min=0) + slack
    else:
        bound = _per_element(q, q.scales, shape) / 2 * (1 + 1e-6) + slack
    assert (err <= bound).all(), f"{name}: worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_is_deterministic_and_fake_quantize_passes_gradients_straight_through(name):
    torch.manual_seed(1)
    w = torch.randn(64, 256, requires_grad=True)
    a, b = quantize(w, name), quantize(w.detach().clone(), name)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    out = fake_quantize(w, name)
    assert torch.equal(out, dequantize(a))  # exactly the stored value, not w + (q − w)
    g = torch.randn_like(w)
    out.backward(g)
    assert torch.equal(w.grad, g)


def test_stored_bytes_per_format():
    x = torch.randn(256, 256)
    n = x.numel()
    assert quantize(x, "fp8").nbytes == n + 4 * 4                 # 2 × 2 FP32 block scales
    assert quantize(x, "mxfp8").nbytes == n + n // 32             # one E8M0 byte per 32
    assert quantize(x, "nvfp4").nbytes == n // 2 + n // 16 + 4    # half a byte each, E4M3 per 16, one FP32
    assert quantize(x, "int4").nbytes == n // 2 + 4 * n // 128    # FP32 scale per 128
    assert quantize(x, "int4_asym").nbytes == n // 2 + 5 * n // 128


def test_an_unknown_format_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"trainer.quantization = 'fp6' is not a format; choose one of fp8, "):
        get_format("fp6", "trainer.quantization")

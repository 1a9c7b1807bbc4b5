"""QuantizedLinear: the matmul sees the format's value of the weight, in training and in serving, and a
serving layer's stored copy follows every change of its weight."""

import pytest
import torch

from miles.config.loader import ConfigError, build
from miles.models.loading import load_model
from miles.precision import linear
from miles.precision.formats import dequantize, quantize
from miles.precision.linear import QuantizedLinear, drop_stored, quantize_linears
from miles.engine.config import EngineConfig
from miles.trainer.config import TrainerConfig


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 64, bias=False)
        self.lm_head = torch.nn.Linear(64, 10, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("mode", ["train", "serve"])
def test_the_matmul_uses_the_stored_weight_and_the_parameters_stay_the_same_objects(mode):
    torch.manual_seed(0)
    model = Tiny()
    params = dict(model.named_parameters())
    assert quantize_linears(model, "mxfp8", mode) == ["up", "down"]  # the LM head stays full precision
    assert dict(model.named_parameters()) == params and isinstance(model.up, QuantizedLinear)
    x = torch.randn(5, 64)
    w = dequantize(quantize(model.up.weight, "mxfp8"))
    assert torch.equal(model.up(x), torch.nn.functional.linear(x, w, model.up.bias))
    assert not torch.equal(model.up(x), torch.nn.functional.linear(x, model.up.weight, model.up.bias))


def test_a_serving_layer_requantizes_after_an_in_place_copy_a_swapped_tensor_and_a_release():
    torch.manual_seed(0)
    model = Tiny()
    quantize_linears(model, "int4", "serve")
    x = torch.randn(3, 64)
    model.up(x)
    cached = model.up._stored._stored
    model.up(x)
    assert model.up._stored._stored is cached  # unchanged weight: no new quantization
    with torch.no_grad():
        model.up.weight.copy_(torch.randn(96, 64))  # what a weight update does in place
    assert torch.equal(model.up.effective_weight(), dequantize(quantize(model.up.weight, "int4")))
    model.up.weight.data = torch.randn(96, 64)  # what an update adopting the received buffer does
    assert torch.equal(model.up.effective_weight(), dequantize(quantize(model.up.weight, "int4")))
    drop_stored(model)
    assert model.up._stored._stored is None


def test_none_leaves_the_model_alone_and_an_unknown_format_names_the_key():
    model = Tiny()
    assert quantize_linears(model, "none", "train") == [] and type(model.up) is torch.nn.Linear
    with pytest.raises(ValueError, match=r"engine quantization = 'fp7' is not a format"):
        quantize_linears(model, "fp7", "serve", key="engine quantization")


class Experts(torch.nn.Module):
    """Stacked expert weights as Qwen3-MoE holds them: (experts, out, in), one matmul per expert."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 40, 64))

    def forward(self, x, expert: int):
        return torch.nn.functional.linear(x, self.w[expert])


@pytest.mark.parametrize("mode", ["train", "serve"])
def test_expert_weights_are_quantized_one_expert_matrix_at_a_time(mode):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.experts = Experts()
    param = model.experts.w
    assert quantize_linears(model, "fp8", mode) == ["experts"]
    x = torch.randn(5, 64, requires_grad=True)
    for e in range(3):
        want = torch.nn.functional.linear(x, dequantize(quantize(param[e], "fp8")))  # its own 128 × 128 scale
        assert torch.equal(model.experts(x, e), want)
    assert model.experts.w is param and dict(model.named_parameters()) == {"experts.w": param}
    if mode == "train":
        model.experts(x, 1).sum().backward()
        assert torch.equal(param.grad[1], torch.ones(5, 40).T @ x.detach()) and param.grad[0].abs().sum() == 0


def test_a_model_with_nothing_to_quantize_is_refused_by_name():
    with pytest.raises(ValueError, match=r"trainer.quantization = 'int4': Sequential has no Linear layer"):
        quantize_linears(torch.nn.Sequential(torch.nn.ReLU()), "int4", "train", key="trainer.quantization")


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_opt_in_embeddings_put_the_tied_embedding_and_lm_head_through_the_format_once(tiny_model_dir, fmt, monkeypatch):
    served = load_model(tiny_model_dir, "float32")
    trained = load_model(tiny_model_dir, "float32")
    tied = served.lm_head.weight
    assert tied is served.model.embed_tokens.weight  # the preset ties them: one weight, two uses
    names = quantize_linears(served, fmt, "serve", embeddings=True)
    quantize_linears(trained, fmt, "train", embeddings=True)
    assert "model.embed_tokens" in names and "lm_head" in names
    assert served.model.embed_tokens._stored is served.lm_head._stored  # one stored copy of the tied weight
    assert set(linear.served_weights(served)) >= {"model.embed_tokens.weight", "lm_head.weight"}

    # Both uses compute with the format's value of the weight: a plain model holding dequantized
    # weights everywhere (Linear, embedding, head) gives the same logits, in serving and in training.
    plain = load_model(tiny_model_dir, "float32")
    with torch.no_grad():
        for m in plain.modules():
            if type(m) in (torch.nn.Linear, torch.nn.Embedding) and m is not plain.lm_head:  # the head is tied
                m.weight.copy_(dequantize(quantize(m.weight, fmt)))
    ids = torch.tensor([[5, 17, 33, 8, 40, 2, 9]])
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(served(ids).logits, want)
        assert torch.equal(trained(ids).logits, want)
        assert not torch.equal(load_model(tiny_model_dir, "float32")(ids).logits, want)

    calls = []
    monkeypatch.setattr(linear, "quantize", lambda *a, **k: calls.append(a[0].shape) or quantize(*a, **k))
    drop_stored(served)
    with torch.no_grad():
        served(ids)
    assert calls.count(tied.shape) == 1  # the tied weight is quantized once for both of its uses


def test_embeddings_without_a_format_or_an_embedding_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.quantize_embeddings = true needs a format"):
        build(TrainerConfig, {"quantize_embeddings": True}).validate()
    with pytest.raises(ConfigError, match=r"engine quantize_embeddings = true needs a format"):
        EngineConfig(model_path="m", quantize_embeddings=True).validate()
    with pytest.raises(ValueError, match=r"trainer.quantization: quantizing embeddings needs a model with "
                                         r"get_input_embeddings\(\) \(Tiny has none\)"):
        quantize_linears(Tiny(), "int4", "train", key="trainer.quantization", embeddings=True)

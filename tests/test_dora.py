"""Factored DoRA norms against the dense formula (float64) and PEFT's own DoRA norm."""

from types import SimpleNamespace

import pytest
import torch

from vllm_bdlora.dora import magnitude_scale, squared_row_norms, unreadable_base_problems
from vllm_bdlora.layers import BlockDiagonalLoRALayer, ProbedWeight
from vllm_bdlora.sharding import ShardGeometry, densify, localize


def factors(out_features=48, in_features=80, rank=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    a = (torch.randn(rank, in_features, generator=g) * 0.3).to(dtype)
    b = (torch.randn(out_features, rank, generator=g) * 0.3).to(dtype)
    return w, a, b


def dense_squared_norms(w, a, b, s):
    return torch.linalg.norm(w.double() + s * b.double() @ a.double(), dim=1) ** 2


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_factored_norm_matches_dense(dtype, rtol, chunk):
    """bf16 inputs are exact in fp32, so both dtypes must match the float64 dense formula to fp32
    accumulation error."""
    w, a, b = factors(dtype=dtype)
    got = squared_row_norms(w, a, b, scaling=0.7, chunk=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_squared_norms(w, a, b, 0.7), rtol=rtol, atol=1e-4)


def test_factored_norm_matches_peft():
    from peft.tuners.lora.dora import DoraLinearLayer

    w, a, b = factors()
    peft_norm = DoraLinearLayer(fan_in_fan_out=False).get_weight_norm(w, b @ a, scaling=0.5)
    torch.testing.assert_close(squared_row_norms(w, a, b, 0.5).sqrt(), peft_norm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallelism", ["column", "row"])
@pytest.mark.parametrize("factor", [None, "a", "b"])
def test_sharded_norms_are_local_or_one_sum(parallelism, factor):
    """Column ranks own whole rows; row ranks' partial squared norms add up to the full ones, for
    standard and BD factors cut by vllm_bdlora.sharding."""
    out_features, in_features, rank, nblocks, tp, s = 32, 64, 8, 2, 2, 0.9
    w, a, b = factors(out_features, in_features, rank)
    a_stored = a[:, : in_features // nblocks] if factor == "a" else a
    b_stored = b[:, : rank // nblocks] if factor == "b" else b
    full_a = densify(a_stored, nblocks) if factor == "a" else a_stored
    full_b = densify(b_stored, nblocks) if factor == "b" else b_stored
    expected = dense_squared_norms(w, full_a, full_b, s)
    got = torch.zeros(out_features, dtype=torch.float64)
    for t in range(tp):
        if parallelism == "column":
            rows = (t * out_features // tp, (t + 1) * out_features // tp)
            geometry = ShardGeometry("column", in_features, out_features, (rows,))
            local = localize(a_stored, b_stored, geometry, factor, nblocks)
            got[rows[0] : rows[1]] = squared_row_norms(w[rows[0] : rows[1]], local.lora_a, local.lora_b, s).double()
        else:
            cols = (t * in_features // tp, (t + 1) * in_features // tp)
            geometry = ShardGeometry("row", in_features, out_features, (cols,))
            local = localize(a_stored, b_stored, geometry, factor, nblocks)
            got += squared_row_norms(w[:, cols[0] : cols[1]], local.lora_a, local.lora_b, s).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_magnitude_scale():
    norms_sq = torch.tensor([4.0, 9.0])
    torch.testing.assert_close(magnitude_scale(torch.tensor([2.0, 6.0]), norms_sq), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "magnitude,norms_sq,message",
    [
        (torch.ones(3), torch.ones(2), r"shape \(3,\), expected \(2,\)"),
        (torch.tensor([1.0, float("nan")]), torch.ones(2), "NaN or Inf"),
        (torch.ones(2), torch.tensor([1.0, 0.0]), r"zero or not finite for output rows \[1\]"),
    ],
)
def test_magnitude_scale_rejects_bad_input(magnitude, norms_sq, message):
    with pytest.raises(ValueError, match=message):
        magnitude_scale(magnitude, norms_sq, "layers.0.q_proj")


@pytest.mark.parametrize(
    "other_rank_id,other_problems,outcome",
    [(7, 0, None), (7 + 1024, 0, "different adapters"), (7 + 3 * 1024, 0, "different adapters"),
     (8, 0, "different adapters"), (7, 1, "rejected")],
)  # fmt: skip
def test_ranks_agree_on_the_adapter_they_load(monkeypatch, other_rank_id, other_problems, outcome):
    """The DoRA all-reduce guard, with a second rank simulated in the all-reduce: same adapter passes; a
    different one (also ids 1024 apart, which the first version's id modulo 1024 let through) is an error;
    a failure on the other rank rejects the adapter here too."""
    import types

    import vllm.distributed

    from vllm_bdlora.adapter_lifecycle import finish

    def all_reduce_with_other_rank(local):
        other = [float(other_problems)] + [float(other_rank_id % 1024), float(other_rank_id // 1024 % 1024)]
        return local + torch.tensor(other + [d * d for d in other[1:]])

    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", all_reduce_with_other_rank)
    layer = types.SimpleNamespace(tp_size=2, device="cpu")
    if outcome is None:
        finish.agree_across_ranks([], layer, "a", 7)
    elif outcome == "rejected":
        with pytest.raises(finish.AdapterRejected):
            finish.agree_across_ranks([], layer, "a", 7)
    else:
        with pytest.raises(RuntimeError, match=outcome):
            finish.agree_across_ranks([], layer, "a", 7)


class Fp8StyleMethod:
    """What vLLM's FP8 linear method keeps and does, in float32 emulation: the weight stored transposed as
    float8_e4m3fn with one per-tensor scale apart, activations quantized with a dynamic per-tensor scale."""

    def apply(self, layer, x, bias=None):
        x_scale = x.abs().max() / 448.0
        x_q = (x / x_scale).to(torch.float8_e4m3fn).float()
        return (x_q @ layer.weight.float()) * (x_scale * layer.weight_scale)


def fp8_style_layer(w: torch.Tensor, input_scale=None):
    scale = w.abs().max() / 448.0
    stored = (w / scale).to(torch.float8_e4m3fn).T
    return SimpleNamespace(weight=stored, weight_scale=scale, quant_method=Fp8StyleMethod(),
                           params_dtype=torch.float32, input_scale=input_scale)  # fmt: skip


def bd_layer_over(base_layer, out_features, in_features):
    """The attributes BlockDiagonalLoRALayer's base-weight methods read, one output slice."""
    layer = SimpleNamespace(base_layer=base_layer, slice_offsets=(0,), output_slices=(out_features,),
                            input_size=in_features, device=torch.device("cpu"))  # fmt: skip
    for name in ("base_weight_rows", "_base_weight_matrix", "base_quantization", "base_weight_unreadable"):
        setattr(layer, name, getattr(BlockDiagonalLoRALayer, name).__get__(layer))
    return layer


@pytest.mark.parametrize("shape", [(64, 64), (48, 80)], ids=["square", "rectangular"])
def test_dora_norm_over_an_fp8_base_is_taken_over_the_dequantized_weight(shape):
    """A square FP8 layer's storage has W's shape (transposed, unscaled): the norm once read it as W. Now it
    reads the effective weight through the layer's GEMM, which dynamic activation quantization passes exactly."""
    w, a, b = factors(*shape, rank=8)
    base = fp8_style_layer(w)
    base.quant_method = type("Fp8LinearMethod", (Fp8StyleMethod,), {})()
    layer = bd_layer_over(base, *shape)
    dequantized = base.weight.float().T * base.weight_scale
    read = layer.base_weight_rows(0)
    assert isinstance(read, ProbedWeight)  # not the storage, even where its shape is (out, in)
    expected = dense_squared_norms(dequantized, a, b, 0.5)
    torch.testing.assert_close(squared_row_norms(read, a, b, 0.5, chunk=16).double(), expected, rtol=1e-5, atol=0)
    assert not torch.allclose(expected, dense_squared_norms(w, a, b, 0.5), rtol=1e-3)  # quantization is visible
    assert unreadable_base_problems([staged_on(layer)]) == []


def test_dora_over_a_base_with_static_activation_scales_is_refused_naming_the_method():
    w, _, _ = factors(64, 64)
    base = fp8_style_layer(w, input_scale=torch.tensor(0.01))
    base.quant_method = type("Fp8LinearMethod", (Fp8StyleMethod,), {})()
    problems = unreadable_base_problems([staged_on(bd_layer_over(base, 64, 64), "o_proj")])
    assert problems == [
        "o_proj: DoRA over a quantized base layer (Fp8LinearMethod, static activation scale) is not served: the "
        "magnitude norm needs the dequantized base weight, which that layer's GEMM cannot return exactly; serve "
        "this adapter on a base quantized with dynamic activation scales or unquantized, or as LoRA without its "
        "magnitudes"
    ]


def staged_on(layer, name="q_proj"):
    return SimpleNamespace(name=name, target=SimpleNamespace(layer=layer))

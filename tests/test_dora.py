"""Factored DoRA norms against the dense formula (float64) and PEFT's own DoRA norm."""

import pytest
import torch

from vllm_bdlora.dora import magnitude_scale, squared_row_norms
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

    from vllm_bdlora import loading

    def all_reduce_with_other_rank(local):
        other = [float(other_problems)] + [float(other_rank_id % 1024), float(other_rank_id // 1024 % 1024)]
        return local + torch.tensor(other + [d * d for d in other[1:]])

    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce", all_reduce_with_other_rank)
    layer = types.SimpleNamespace(tp_size=2, device="cpu")
    if outcome is None:
        loading._agree_across_ranks([], layer, "a", 7)
    elif outcome == "rejected":
        with pytest.raises(loading.AdapterRejected):
            loading._agree_across_ranks([], layer, "a", 7)
    else:
        with pytest.raises(RuntimeError, match=outcome):
            loading._agree_across_ranks([], layer, "a", 7)


def test_dora_over_a_quantized_base_layer_is_refused_naming_the_method():
    from types import SimpleNamespace

    from vllm_bdlora.dora import quantized_base_problems

    def item(name, method):
        return SimpleNamespace(
            name=name, target=SimpleNamespace(layer=SimpleNamespace(base_quantization=lambda: method))
        )

    problems = quantized_base_problems([item("o_proj", "Fp8LinearMethod"), item("q_proj", None)])
    assert problems == [
        "o_proj: DoRA over a quantized base layer (Fp8LinearMethod) is not served: the magnitude norm needs the "
        "dequantized base weight; serve this adapter on an unquantized base, or as LoRA without its magnitudes"
    ]

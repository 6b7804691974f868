"""The per-rank slicing rules against the dense formula, in float64."""

import pytest
import torch

from vllm_bdlora.sharding import ShardGeometry, ShardingError, densify, localize, per_rank_width


def random_factors(factor, nblocks, d_in, d_out, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, d_in // nblocks if factor == "a" else d_in, generator=g, dtype=torch.float64)
    b = torch.randn(d_out, r // nblocks if factor == "b" else r, generator=g, dtype=torch.float64)
    dense_a = densify(a, nblocks) if factor == "a" else a
    dense_b = densify(b, nblocks) if factor == "b" else b
    return a, b, dense_b @ dense_a


def sharded_delta(a, b, factor, nblocks, d_in, d_out, tp, parallelism):
    """Sum of what each rank computes, laid out as the full (out, in) delta."""
    delta = torch.zeros(d_out, d_in, dtype=torch.float64)
    widths = []
    for rank in range(tp):
        if parallelism == "column":
            rows = (rank * d_out // tp, (rank + 1) * d_out // tp)
            local = localize(a, b, ShardGeometry("column", d_in, d_out, (rows,)), factor, nblocks)
            delta[rows[0] : rows[1]] += local.lora_b @ local.lora_a
        else:
            cols = (rank * d_in // tp, (rank + 1) * d_in // tp)
            local = localize(a, b, ShardGeometry("row", d_in, d_out, (cols,)), factor, nblocks)
            delta[:, cols[0] : cols[1]] += local.lora_b @ local.lora_a
        widths.append(local.width)
    return delta, widths


@pytest.mark.parametrize("parallelism", ["column", "row"])
@pytest.mark.parametrize("factor,nblocks", [(None, 1), ("a", 2), ("b", 2), ("a", 4), ("b", 4), ("a", 8), ("b", 8)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_together_compute_the_dense_delta(parallelism, factor, nblocks, tp):
    d_in, d_out, r = 48, 32, 16
    a, b, dense = random_factors(factor, nblocks, d_in, d_out, r)
    delta, widths = sharded_delta(a, b, factor, nblocks, d_in, d_out, tp, parallelism)
    torch.testing.assert_close(delta, dense, rtol=1e-12, atol=1e-12)
    designed = (parallelism == "column" and factor == "b") or (parallelism == "row" and factor == "a")
    if designed and nblocks % tp == 0:
        assert widths == [r // tp] * tp  # BD-LoRA's saving: rank r/TP per GPU
    elif not designed:
        assert widths == [r] * tp  # standard, or densified wrong-side factor: full rank everywhere


@pytest.mark.parametrize("parallelism", ["column", "row"])
@pytest.mark.parametrize("factor,nblocks", [(None, 1), ("a", 4), ("b", 4)])
def test_a_cut_without_copies_is_the_same_share_and_copies_nothing_twice(parallelism, factor, nblocks):
    """`copy=False` (an admission copying the shares straight into a slot image): the same values, the factors that
    are one slice of the stored ones being views of them; with copies, nothing is a view of the stored factors."""
    d_in, d_out, r, tp = 48, 32, 16, 4
    a, b, _ = random_factors(factor, nblocks, d_in, d_out, r)
    for rank in range(tp):
        owned = ((rank * (d_out if parallelism == "column" else d_in) // tp,
                  (rank + 1) * (d_out if parallelism == "column" else d_in) // tp),)  # fmt: skip
        geometry = ShardGeometry(parallelism, d_in, d_out, owned)
        copied, viewed = (
            localize(a, b, geometry, factor, nblocks),
            localize(a, b, geometry, factor, nblocks, copy=False),
        )
        assert torch.equal(copied.lora_a, viewed.lora_a) and torch.equal(copied.lora_b, viewed.lora_b)
        stored = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
        assert not {t.untyped_storage().data_ptr() for t in (copied.lora_a, copied.lora_b)} & stored
        shared = {t.untyped_storage().data_ptr() for t in (viewed.lora_a, viewed.lora_b)} & stored
        designed = (parallelism == "column" and factor == "b") or (parallelism == "row" and factor == "a")
        assert len(shared) == (1 if factor and not designed else 2)  # a wrong-side factor is densified: new


def test_blocks_spanning_ranks_are_shared():
    """nblocks=2 at TP=4: each block covers two ranks; both hold it (width r/2), still exact."""
    a, b, dense = random_factors("b", 2, 16, 16, 8)
    delta, widths = sharded_delta(a, b, "b", 2, 16, 16, 4, "column")
    torch.testing.assert_close(delta, dense)
    assert widths == [4, 4, 4, 4]


def test_non_contiguous_shard_like_fused_qkv():
    """A rank of a fused qkv layer owns three separate row ranges."""
    a, b, dense = random_factors("b", 4, 8, 24, 8)
    owned = ((0, 4), (8, 10), (16, 18))
    local = localize(a, b, ShardGeometry("column", 8, 24, owned), "b", 4)
    rows = torch.cat([torch.arange(s, e) for s, e in owned])
    torch.testing.assert_close(local.lora_b @ local.lora_a, dense[rows])
    assert local.blocks == (0, 1, 2)


@pytest.mark.parametrize(
    "factor,a_shape,b_shape,message",
    [
        ("b", (16, 32), (32, 16), r"expected lora_A \(16, 32\) and lora_B \(32, 8\)"),
        ("a", (16, 32), (32, 16), r"expected lora_A \(16, 16\) and lora_B \(32, 16\)"),
        (None, (16, 31), (32, 16), r"got lora_A \(16, 31\)"),
        ("b", (15, 32), (32, 7), r"r=15 is not divisible by nblocks=2"),
    ],
)
def test_shape_errors_name_expected_and_actual(factor, a_shape, b_shape, message):
    geometry = ShardGeometry("column", 32, 32, ((0, 16),))
    with pytest.raises(ShardingError, match=message):
        localize(torch.zeros(a_shape), torch.zeros(b_shape), geometry, factor, 2)


def test_out_features_not_divisible_by_nblocks():
    geometry = ShardGeometry("column", 8, 30, ((0, 15),))
    with pytest.raises(ShardingError, match="out_features=30 is not divisible by nblocks=4"):
        localize(torch.zeros(8, 8), torch.zeros(30, 2), geometry, "b", 4)


def test_per_rank_width():
    assert per_rank_width(64, 2) == 32
    with pytest.raises(ValueError, match="not divisible by --tensor-parallel-size 3"):
        per_rank_width(64, 3)


def test_replicated_kv_heads_are_served_exactly_but_wider():
    """TP=4 with 2 KV heads: vLLM gives ranks 0,1 KV head 0 and ranks 2,3 head 1. With nblocks=4 the
    k_proj blocks are half a head tall, so each rank needs two blocks (width r/2 instead of r/4)."""
    from types import SimpleNamespace

    from vllm_bdlora.layers import _qkv_geometry

    head, r, hidden = 8, 16, 32
    a, b, dense = random_factors("b", 4, hidden, 2 * head, r)
    for rank in range(4):
        base = SimpleNamespace(num_kv_head_replicas=2, num_heads=1, num_kv_heads=1, head_size=head, v_head_size=head,
                               total_num_heads=4, total_num_kv_heads=2)  # fmt: skip
        k_size, k_owned = _qkv_geometry(SimpleNamespace(base_layer=base, tp_rank=rank))[1]
        assert k_size == 2 * head and k_owned == ((rank // 2) * head, (rank // 2 + 1) * head)
        local = localize(a, b, ShardGeometry("column", hidden, k_size, (k_owned,)), "b", 4)
        torch.testing.assert_close(local.lora_b @ local.lora_a, dense[k_owned[0] : k_owned[1]])
        assert local.width == r // 2


def bare_layer(cls, **attributes):
    """A BD layer object with just the attributes shard_geometry reads (no vLLM layer construction)."""
    layer = cls.__new__(cls)
    for name, value in attributes.items():
        object.__setattr__(layer, name, value)
    return layer


def test_layer_geometries():
    from types import SimpleNamespace

    from vllm_bdlora import layers

    merged = SimpleNamespace(input_size=16, output_size=32, output_sizes=[16, 16])
    # gate_up loaded from one adapter module: each rank owns a slice of gate and of up
    single = bare_layer(layers.BlockDiagonalColumnParallelLinearWithLoRA, base_layer=merged, tp_rank=1, tp_size=2)
    assert single.shard_geometry(0) == ShardGeometry("column", 16, 32, ((8, 16), (24, 32)))
    # gate_proj and up_proj as two adapter modules
    packed = bare_layer(layers.BlockDiagonalMergedColumnParallelLinearWithLoRA, base_layer=merged, tp_rank=1, tp_size=2)
    assert packed.shard_geometry(1) == ShardGeometry("column", 16, 16, ((8, 16),))
    qkv = SimpleNamespace(input_size=16, num_heads=2, num_kv_heads=1, head_size=4, v_head_size=4, total_num_heads=4,
                          total_num_kv_heads=2, num_kv_head_replicas=1)  # fmt: skip
    fused = bare_layer(layers.BlockDiagonalQKVParallelLinearWithLoRA, base_layer=qkv, tp_rank=1, tp_size=2)
    assert fused.shard_geometry(0) == ShardGeometry("column", 16, 32, ((8, 16), (20, 24), (28, 32)))
    row_base = SimpleNamespace(input_size=32, output_size=16, input_size_per_partition=16)
    row = bare_layer(layers.BlockDiagonalRowParallelLinearWithLoRA, base_layer=row_base, tp_rank=1, tp_size=2)
    assert row.shard_geometry(0) == ShardGeometry("row", 32, 16, ((16, 32),))

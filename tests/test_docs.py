"""The README and docs/: every relative link resolves (file and #anchor), and the README stays a front door."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_BYTES = 12 * 1024


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The #anchors of a Markdown page's headings (outside code blocks), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    links = [a or b for a, b in LINK.findall(text)]
    return [link for link in links if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(REPO) if target.is_relative_to(REPO) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [anchor](#nowhere)\n")
    assert relative_links(page) == ["#title", "missing.md", "#nowhere"]
    assert anchors(page) == {"title"}


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < README_MAX_BYTES
    first_screen = text[:1500]
    assert "FP8" in first_screen and "RL teams" in first_screen  # what it is, who it is for
    assert "# set up and run the demo" in first_screen and "# set up and run the tests" in first_screen
    assert (REPO / "LICENSE").exists()


def test_the_readme_python_example_runs(tmp_path, capsys):
    """The README's example, on CPU, with two small local checkpoints that carry the demo tokenizer."""
    from tests.hf_checkpoints import add_text_files, write_hf_checkpoint

    text = (REPO / "README.md").read_text()
    code = re.search(r"## In Python\n\n```python\n(.*?)```", text, re.DOTALL).group(1)
    a, b = (
        write_hf_checkpoint(tmp_path / n, "Qwen3ForCausalLM", seed=i, num_layers=3, vocab=640)
        for i, n in enumerate("ab")
    )
    add_text_files(a)
    code = code.replace('"path/to/Qwen3-8B"', repr(str(a))).replace('"path/to/checkpoint-step-200"', repr(str(b)))
    code = code.replace('device="cuda"', 'device="cpu"').replace("max_seq_len=2048", "max_seq_len=160")
    assert code.count(repr(str(a))) == 1 and code.count(repr(str(b))) == 1  # the example's paths, found
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].startswith("'") and printed[0].split()[-2] in ("stop", "length")
    assert printed[1].endswith("[0, 1, 2]")  # updated_decoder_layers: every layer of B


@pytest.mark.parametrize("page, notes", [("README.md", False), ("docs/api.md", True)])
def test_config_field_tables_are_the_code_table(page, notes):
    """The README's and docs/api.md's config.json tables are layerwise.config_fields.render_markdown's output."""
    from layerwise.config_fields import render_markdown

    text = (REPO / page).read_text()
    block = re.search(r"<!-- config-fields:begin[^>]*-->\n(.*?)<!-- config-fields:end -->", text, re.DOTALL)
    assert block is not None, f"{page} has no config-fields block"
    assert block.group(1) == render_markdown(notes), f"{page}: paste render_markdown(notes={notes}) again"

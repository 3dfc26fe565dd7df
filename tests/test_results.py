"""bench/RESULTS.md is the reference the code and docs cite by heading, bench/LOG.md the history
beside it, bench/charts/ the charts. A citation is the file's path, a comma and a heading in double
quotes (it may wrap over lines, comment markers included); it must name a `##` or `###` heading of
that file. A chart is any path under bench/ ending in .png, or a Markdown image or link target; it
must exist."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = {"RESULTS": ROOT / "bench" / "RESULTS.md", "LOG": ROOT / "bench" / "LOG.md"}
CITATION = re.compile(r'bench/(RESULTS|LOG)\.md`?,\s*(?:#\s*)?"([^"]+)"')
MENTION = re.compile(r"bench/(?:RESULTS|LOG)\.md")
CHART_PATH = re.compile(r"(?<![\w/.-])bench/[\w./-]+?\.png\b")
LINK_TARGET = re.compile(r"\]\(([^)\s]+\.png)\)")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt"}
SKIP = {"__pycache__", "build", "dist", "node_modules"}


def text_files(root=ROOT):
    """The repository's own text files: no hidden folders (.git, virtual environments), no builds."""
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if (path.suffix in SUFFIXES and path.is_file()
                and not any(p.startswith(".") or p in SKIP or p.endswith(".egg-info") for p in parts)):
            yield path


def headings(path):
    """The `##` and `###` headings of a Markdown file, as written after the hashes."""
    return [m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", path.read_text(), re.M)]


def one_line(quoted):
    """A heading as cited: a citation wrapped over lines (with indentation or a comment marker at
    the start of the next line) reads as one line."""
    return re.sub(r"\s*\n\s*(#\s*)?", " ", quoted).strip()


def broken_citations(files, docs=DOCS):
    """(file, cited file, heading) for each citation whose heading the cited file lacks."""
    known = {name: set(headings(path)) for name, path in docs.items()}
    return [(str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f), name, one_line(quoted))
            for f in files for name, quoted in CITATION.findall(f.read_text())
            if one_line(quoted) not in known[name]]


def missing_charts(files, root=ROOT):
    """(file, chart) for each chart path under bench/ (from the repository root) or Markdown link
    target ending in .png (from the file's folder) that does not exist."""
    missing = []
    for f in files:
        text = f.read_text()
        missing += [(str(f), p) for p in CHART_PATH.findall(text) if not (root / p).is_file()]
        if f.suffix == ".md":
            missing += [(str(f), t) for t in LINK_TARGET.findall(text)
                        if not t.startswith(("http:", "https:")) and not (f.parent / t).is_file()]
    return missing


def bare_mentions(files):
    """(file, count) for each file that names a results file without a heading."""
    counts = [(f, len(MENTION.findall(t)) - len(CITATION.findall(t))) for f in files for t in [f.read_text()]]
    return [(str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f), n) for f, n in counts if n]


def test_every_citation_names_a_heading():
    files = list(text_files())
    assert any(CITATION.search(f.read_text()) for f in files if "mlx_flashnorm" in f.parts)
    assert broken_citations(files) == []


def test_code_cites_a_heading_not_the_whole_file():
    """In the package every mention of the results names its section: a claim in the code points
    at the one place that measured it."""
    assert bare_mentions(text_files(ROOT / "mlx_flashnorm")) == []


def test_headings_are_unique_names():
    for path in DOCS.values():
        names = headings(path)
        assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_every_linked_chart_exists_in_one_folder():
    assert missing_charts(list(text_files())) == []
    charts = ROOT / "bench" / "charts"
    pngs = sorted((ROOT / "bench").rglob("*.png"))
    assert pngs and all(p.parent == charts for p in pngs), pngs
    linked = {Path(p).name for f in DOCS.values() for p in CHART_PATH.findall(f.read_text())}
    assert {p.name for p in pngs} <= linked, "charts no document links"


# written in two parts, so that this file's own examples are not citations or chart links
RESULTS, LOG, BENCH = "bench/" + "RESULTS.md", "bench/" + "LOG.md", "bench" + "/"


@pytest.mark.parametrize("cite, broken", [
    (f'({RESULTS}, "Perplexity")', False),
    (f'({RESULTS}, "Sec. 4 epsilon on\n    # Gemma 3")', False),
    (f'({RESULTS},\n    # "Self-check cost")', False),
    (f'({RESULTS},\n    # "Self-check")', True),
    (f'(`{RESULTS}`, "Half precision")', False),
    (f'({LOG}, "Fifth pass: where a decode step\'s GPU time went, per kernel (issue 11)")', False),
    (f'({RESULTS}, "Fifth pass")', True),
    (f'({RESULTS}, "Perplexity (issue 4)")', True),
    (f'({LOG}, "Perplexity")', True),
])
def test_a_broken_citation_is_found(tmp_path, cite, broken):
    """The check itself: a citation of a heading the file lacks (an old pass's name, a heading
    with its old suffix, or one that lives in the other file) is reported; a good one, wrapped or
    not, is not."""
    src = tmp_path / "x.py"
    src.write_text(f'"""A claim {cite}."""\n')
    assert bool(broken_citations([src])) == broken


def test_a_bare_mention_is_found(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(f'"""One claim ({RESULTS}, "Perplexity"), another ({RESULTS}), a third ({LOG})."""\n')
    assert bare_mentions([src]) == [(str(src), 2)]


def test_a_missing_chart_is_found(tmp_path):
    """A chart path left at its old place and a link to no file are reported; a good one is not."""
    doc = tmp_path / "notes.md"
    doc.write_text(f"Chart: {BENCH}matrix-cuda-ninth-h100.png, {BENCH}charts/matrix-cuda-ninth-h100.png, "
                   "![x](charts/none.png)\n")
    assert missing_charts([doc]) == [(str(doc), f"{BENCH}matrix-cuda-ninth-h100.png"),
                                     (str(doc), "charts/none.png")]

"""Every requirement id and `SPEC §N` the code and the tests cite is explained in
docs/requirements.md (CONVENTIONS: someone who has only the repository can look it up).

Ids are read where they are cited, not from the code around them: in comments and string
literals (docstrings), and in test names (`test_fault8_C5_P1_…`), found with Python's
tokenizer. An id is a letter the specification's ids use followed by one digit 1-9,
standing alone: `(S4)`, `S4:`, `S1-S5`, `§22 T3`, but not `F16`, `Q4_K_M`, `0xA1`,
`#F3F3F3`, `E501` or a variable such as `T0`.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "requirements.md"

LETTERS = "CDEFKLMOPRSTUVWX"
# In text: not glued to a word, a colour, a version or a flag (`--X5`) on either side.
TEXT_ID = re.compile(rf"(?<![\w#.])(?<!--)([{LETTERS}][1-9])(?![\w])")
SECTION = re.compile(r"SPEC §(\d+)")
# The §s a comment cites after the first: `SPEC §9 C1, C3, §10 P4`.
MORE_SECTIONS = re.compile(r"(?<=[\s,(])§(\d+)")
NAME_ID = re.compile(rf"^[{LETTERS}][1-9]$")


# Where the code is: Python read through its tokenizer; the dashboard's templates, scripts
# and styles, and the packaged config, read whole (their comments are mixed with the rest).
FOLDERS = ("corrallm", "tests", "bench", "examples", "scripts")
TEXTS = ("*.html", "*.js", "*.css", "*.yaml")


def sources() -> list[Path]:
    found = [path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")]
    found += [path for pattern in TEXTS for path in (ROOT / "corrallm").rglob(pattern)]
    return sorted(found)


def cited(path: Path) -> tuple[set[str], set[str]]:
    """The ids and the SPEC section numbers `path` cites."""
    ids: set[str] = set()
    sections: set[str] = set()
    text = path.read_text()
    if path.suffix != ".py":
        return set(TEXT_ID.findall(text)), _sections(text)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            ids.update(TEXT_ID.findall(token.string))
            sections.update(_sections(token.string))
        elif token.type == tokenize.NAME and token.string.startswith("test_"):
            ids.update(name_ids(token.string))
    return ids, sections


def _sections(text: str) -> set[str]:
    """`SPEC §9 C1, C3, §10 P4` -> 9, 10 (a bare § only where SPEC § is cited too)."""
    if not SECTION.search(text):
        return set()
    return {*SECTION.findall(text), *MORE_SECTIONS.findall(text)}


def name_ids(name: str) -> list[str]:
    """The ids in a test's name: `test_fault8_C5_P1_pause` -> C5, P1."""
    return [part for part in name.split("_") if NAME_ID.match(part)]


def documented() -> tuple[set[str], set[str]]:
    """The ids explained (a bold `**L2 …**` entry) and the sections in the § table."""
    text = DOC.read_text()
    ids = set(re.findall(rf"^- \*\*([{LETTERS}][1-9])\b", text, re.M))
    sections = set(re.findall(r"^\| (\d+) +\|", text, re.M))
    return ids, sections


def test_the_tokenizer_finds_ids_where_they_are_cited_and_nowhere_else() -> None:
    assert TEXT_ID.findall("(S4) S4: SPEC §22 T3, S1-S5 R1/R2 [K6]") == [
        "S4",
        "S4",
        "T3",
        "S1",
        "S5",
        "R1",
        "R2",
        "K6",
    ]
    assert TEXT_ID.findall("F16 Q4_K_M 0xA1 #F3F3F3 E501 T0 x5 X55 --X5 v1.S2 W3a") == []
    assert name_ids("test_fault8_C5_P1_pause_F16") == ["C5", "P1"]


def test_every_id_the_code_and_tests_use_is_explained_in_docs_requirements() -> None:
    explained, _ = documented()
    missing: dict[str, list[str]] = {}
    for path in sources():
        for rid in cited(path)[0] - explained:
            missing.setdefault(rid, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"ids used but not explained in docs/requirements.md: {missing}"


def test_every_spec_section_cited_is_in_the_table_of_docs_requirements() -> None:
    _, table = documented()
    missing: dict[str, list[str]] = {}
    for path in sources():
        for section in cited(path)[1] - table:
            missing.setdefault(section, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"SPEC sections cited but not in docs/requirements.md: {missing}"


def test_the_page_explains_each_id_once() -> None:
    text = DOC.read_text()
    entries = re.findall(rf"^- \*\*([{LETTERS}][1-9])\b", text, re.M)
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)

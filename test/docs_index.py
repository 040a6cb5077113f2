"""What the documentation site lists that the code decides: the notes, the environment variables, the ops.

`python test/docs_index.py` rewrites docs/contributing/notes.md from the code; test/test_docs_site.py checks that
each page matches what is here.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTES_PAGE = ROOT / "docs" / "contributing" / "notes.md"
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".inc", ".cu", ".cuh")

# A note is defined where a comment or docstring line starts with "Note [Title]" followed by ":" or nothing;
# "Note [Title]" anywhere else cites it.
NOTE_DEFINITION = re.compile(r"^\s*(?:#|//|\*|\"\"\")?\s*Note \[([^\]]+)\](?::|\s*$)")
NOTE_CITATION = re.compile(r"Note \[([^\]]+)\]")


def _sources(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in sorted((ROOT / folder).rglob("*")) if p.suffix in SOURCE_SUFFIXES]
    return files + [ROOT / "setup.py", ROOT / "_torchqkit_startup.py"]  # the interpreter-start hook ships too


def note_definitions() -> dict[str, list[str]]:
    """Each note's title -> the files that define it (product code only: torchqkit/, csrc/, setup.py and
    _torchqkit_startup.py)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in _sources("torchqkit", "csrc"):
        rel = path.relative_to(ROOT).as_posix()
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            m = NOTE_DEFINITION.match(line)
            if m and rel not in found[m.group(1)]:
                found[m.group(1)].append(rel)
    return dict(found)


def note_citations() -> dict[str, set[str]]:
    """Each cited note title -> the files citing it (tests and benchmarks included)."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in _sources("torchqkit", "csrc", "test", "benchmarks", "tutorials"):
        if path == Path(__file__).resolve():
            continue  # this file names the pattern itself
        for title in NOTE_CITATION.findall(path.read_text(encoding="utf-8", errors="replace")):
            found[_one_line(title)].add(path.relative_to(ROOT).as_posix())
    return dict(found)


def _one_line(title: str) -> str:
    """A title cited across a line break (comment markers, or adjacent string literals) as written in one line."""
    title = re.sub(r'"\s*\n\s*"', "", title)
    return re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", title)


def notes_page() -> str:
    defs = note_definitions()
    rows = sorted(defs.items(), key=lambda item: (item[1][0], item[0].lower()))
    lines = ["# Index of notes", "",
             "A `Note [Title]` is an explanation that several places in the code rely on: written once, where its "
             "subject lives,", "and cited by its title elsewhere. Search the file for the title to read it. This "
             "page is made from the code", "(`python test/docs_index.py`); a test keeps it complete.", "",
             "| note | defined in |", "|---|---|"]
    lines += [f"| {title} | {', '.join(f'`{f}`' for f in files)} |" for title, files in rows]
    return "\n".join(lines) + "\n"


def environment_variables() -> set[str]:
    """Every TORCHQKIT_* variable the product reads (Python os.environ, C++ getenv)."""
    read = re.compile(r"(?:environ(?:\.get)?\(?\[?|getenv\()\s*\"(TORCHQKIT_[A-Z0-9_]+)\"")
    constant = re.compile(r"=\s*\"(TORCHQKIT_[A-Z0-9_]+)\"")  # SILENCE_ENV = "TORCHQKIT_...", read through the name
    names = set()
    for path in _sources("torchqkit", "csrc"):
        text = path.read_text(encoding="utf-8", errors="replace")
        names |= set(read.findall(text)) | set(constant.findall(text))
    return names


if __name__ == "__main__":
    NOTES_PAGE.write_text(notes_page(), encoding="utf-8")
    print(f"wrote {NOTES_PAGE.relative_to(ROOT)}: {len(note_definitions())} notes")

"""The docs made from code are up to date: scripts/gendocs would change nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_parts_of_man_pages_and_readme_are_current() -> None:
    cp = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gendocs"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr


# -- names in the docs exist -------------------------------------------------------

import ast  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402

KRELD = REPO / "kreld"
# Files whose words are documentation: docstrings and comments of kreld/, the
# README, docs/, the man pages, the shipped configuration and units.
DOC_FILES = sorted(
    [*KRELD.rglob("*.py"), REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md"),
     *(REPO / "man").iterdir(), *(p for p in (REPO / "etc").rglob("*") if p.is_file()),
     *(REPO / "systemd").iterdir()]
)  # fmt: skip
# kreld.x.y: a module, or an attribute of one.  Not io.kreld.X (a varlink name), not
# a file name (kreld.toml, kreld.service, kreld.lock, ...), not a call (kreld.resolve(...)
# in an example, where kreld is a client).
_DOTTED = re.compile(r"(?<![\w./-])kreld((?:\.[A-Za-z_]\w*)+)(?![\w(-])")
_NOT_MODULES = {"toml", "service", "socket", "sock", "lock", "sysusers", "conf", "log"}
# kreld/x/y.py or kreld/x/: a path in the checkout.
_PATH = re.compile(r"(?<![\w./-])kreld/[\w/]+(?:\.\w+)*")


def _exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        name = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(name) is not None
        except (ModuleNotFoundError, ValueError):
            found = False
        if found:
            obj: object = importlib.import_module(name)
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_every_kreld_module_and_path_the_docs_name_exists() -> None:
    stale = []
    for path in DOC_FILES:
        text = path.read_text(errors="replace")
        for m in _DOTTED.finditer(text):
            if m[1].split(".")[1] in _NOT_MODULES:
                continue
            if not _exists("kreld" + m[1]):
                stale.append(f"{path.relative_to(REPO)}: kreld{m[1]}")
        for m in _PATH.finditer(text):
            rel = m[0].rstrip("/.")
            if not (REPO / rel).exists():
                stale.append(f"{path.relative_to(REPO)}: {rel}")
    assert not stale, "names that do not exist:\n" + "\n".join(sorted(set(stale)))


def test_each_folder_docstring_names_every_module_of_its_folder() -> None:
    missing = []
    for init in sorted(KRELD.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for mod in sorted(init.parent.glob("*.py")):
            if (
                mod.stem != "__init__"
                and f"``{mod.stem}``" not in doc
                and (f":mod:`.{mod.stem}`" not in doc)
            ):
                missing.append(f"{init.parent.name}/{mod.name}")
    assert not missing, f"folder docstrings that do not name these modules: {missing}"


def test_readme_names_every_method_of_the_interface() -> None:
    from kreld.varlink.interface import IO_KRELD

    readme = (REPO / "README.md").read_text()
    absent = [m for m in IO_KRELD.methods if f"`{m}`" not in readme]
    assert not absent, f"README does not name these io.kreld methods: {absent}"


# Beside the docs: the tests, the benches (and the results they write) and the
# scripts, whose docstrings and comments are read as much.
OTHER_FILES = sorted(
    p
    for folder in ("tests", "bench", "scripts", ".ci")
    for p in (REPO / folder).rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix in ("", ".py", ".md", ".sh")
)


def test_no_issue_numbers_in_code_or_docs() -> None:
    """Comments and docs say the reason, never the ticket: the reader next year
    has no tracker."""
    ticket = re.compile(r"\b(?:issue|ticket)s? *#?\d+", re.I)
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in [*DOC_FILES, *OTHER_FILES]
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if ticket.search(line)
    ]
    assert not found, f"issue numbers at {found}"


# What a newcomer reads, in the order they need it: what and why (before the
# first heading), install, a quick start, the profiler's API, configuration,
# the fleet, the architecture, development.  Internals go to docs/, the
# changes to CHANGELOG.md.
README_SECTIONS = [
    "Install on a host",
    "Quick start",
    "For profilers: the socket",
    "Configuration",
    "A fleet: object storage",
    "Architecture",
    "Development",
]


def test_readme_is_short_and_in_a_newcomers_order() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 250, "README.md: 250 lines or more; move internals to docs/"
    assert re.findall(r"^## (.+)$", text, re.M) == README_SECTIONS
    assert not re.search(r"^#+ .*(change ?log|changes|history)", text, re.I | re.M)
    assert (REPO / "CHANGELOG.md").is_file()


# `test_x.py::test_name` in the docs: the proof a claim cites.  A name cut short
# ends in an ellipsis ("test_a_kcore_whose_headers_point_anywhere_…"): a prefix.
_CITED = re.compile(r"(test_\w+\.py)::(test_\w+)(…|\.\.\.)?")


def test_every_test_the_docs_cite_exists() -> None:
    tests = {p.name: p.read_text() for p in (REPO / "tests").rglob("test_*.py")}
    missing = []
    for path in DOC_FILES:
        for m in _CITED.finditer(path.read_text(errors="replace")):
            file, name, cut = m.groups()
            end = r"\w*" if cut else r"\b"
            if file not in tests or not re.search(rf"def {name}{end}", tests[file]):
                missing.append(f"{path.relative_to(REPO)}: {file}::{name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)

"""The import direction README's "Architecture" section describes, enforced.

``kreld/`` is folders by concern; each folder sits in one layer, and a file
imports only from its own folder, its layer, or the layers below (every
import counts, also one inside a function).  The three programs at the top
(``client.py``, ``daemon.py`` with its ``startup.py``, ``cli.py``) are files of
their own.  The source is read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

KRELD = Path(__file__).resolve().parents[2] / "kreld"
README = KRELD.parent / "README.md"

# The layers, lowest first: README.md's "Architecture" section, in code.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("__init__", "core"),
    "config": ("config",),
    "kernel": ("kernel", "debuginfo"),
    "store": ("store",),
    "protocol": ("varlink",),
    "engines": ("symbols", "tracker"),
    "server": ("server",),
    "tools": ("perf", "fleet"),
    "cli": ("ctl",),
    "programs": ("client", "startup", "daemon", "cli", "programs"),
}
LAYER_OF = {unit: i for i, units in enumerate(LAYERS.values()) for unit in units}
NAMES = list(LAYERS)


def kreld_units() -> dict[str, list[Path]]:
    """Folder or top-level file name -> its source files."""
    out: dict[str, list[Path]] = {}
    for path in sorted(KRELD.rglob("*.py")):
        rel = path.relative_to(KRELD)
        name = rel.parts[0] if len(rel.parts) > 1 else path.stem
        out.setdefault(name, []).append(path)
    return out


def imported_modules(paths: list[Path]) -> set[str]:
    """The dotted kreld modules *paths* import (``kreld.core.model``), lazily or not."""
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("kreld.")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = node.module
                if module == "kreld" or module.startswith("kreld."):
                    found |= {f"{module}.{a.name}" for a in node.names}
    return found


def imports_of(paths: list[Path]) -> set[str]:
    """The folders (or top-level files) of kreld that *paths* import."""
    units = set(kreld_units())
    out = set()
    for name in imported_modules(paths):
        part = name.split(".")[1]
        out.add(part if part in units else "__init__")
    return out


def test_every_folder_and_file_of_kreld_has_a_layer() -> None:
    """A new folder or top-level file is placed in the architecture before it lands."""
    unplaced = sorted(set(kreld_units()) - set(LAYER_OF))
    assert not unplaced, f"add these to LAYERS (and README's Architecture section): {unplaced}"
    assert not sorted(set(LAYER_OF) - set(kreld_units())), "LAYERS names a folder that is gone"


def test_imports_go_down_the_layers_never_up() -> None:
    upward = []
    for unit, paths in kreld_units().items():
        for imported in imports_of(paths) - {unit}:
            if LAYER_OF[imported] > LAYER_OF[unit]:
                upward.append(
                    f"{unit} ({NAMES[LAYER_OF[unit]]}) imports "
                    f"{imported} ({NAMES[LAYER_OF[imported]]})"
                )
    assert not upward, "\n".join(upward)


def test_folders_of_one_layer_do_not_import_each_other_both_ways() -> None:
    """No circle between two folders of one layer (symbols and tracker, perf and fleet)."""
    units = kreld_units()
    for names in LAYERS.values():
        for a in names:
            for b in names:
                if a < b:
                    both = b in imports_of(units[a]) and a in imports_of(units[b])
                    assert not both, f"{a} and {b} import each other"


def test_the_model_imports_nothing_of_kreld_but_consts_errors_and_record() -> None:
    mods = {
        m.rsplit(".", 1)[0] if m.count(".") > 2 else m
        for m in imported_modules([KRELD / "core" / "model.py"])
    }
    assert mods <= {"kreld.core.consts", "kreld.core.errors", "kreld.core.record"}, mods


def test_the_core_imports_nothing_outside_itself() -> None:
    assert imports_of(kreld_units()["core"]) <= {"core", "__init__"}


def test_readers_of_the_kernel_never_import_the_store_server_or_programs() -> None:
    forbidden = {"store", "server", "symbols", "tracker", "cli", "daemon", "client"}
    assert not imports_of(kreld_units()["kernel"]) & forbidden


def test_the_record_time_path_never_reaches_debuginfo() -> None:
    """Finding and fetching debug files is for answering: the readers of the
    kernel, the store and the tracker (what records) never import it."""
    units = kreld_units()
    for unit in ("kernel", "store", "tracker", "core", "config"):
        assert "debuginfo" not in imports_of(units[unit]), unit


def test_the_protocol_has_no_sockets_and_imports_only_the_core() -> None:
    units = kreld_units()
    assert imports_of(units["varlink"]) <= {"core", "varlink"}
    for path in units["varlink"]:
        assert "socket" not in imported_names(path), path


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_programs_are_imported_by_nothing_in_kreld() -> None:
    """``cli`` and ``daemon`` are programs: no other file depends on them."""
    for unit, paths in kreld_units().items():
        assert unit == "programs" or not imports_of(paths) & {"cli", "daemon"} - {unit}, unit


def test_every_folder_says_what_it_is_for() -> None:
    """Each folder's ``__init__`` has a docstring saying what it holds."""
    for folder in (p for p in KRELD.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.name}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{folder.name}/__init__.py says nothing of what it is for"


def test_readme_architecture_names_every_folder_and_program() -> None:
    section = re.search(r"^## Architecture\n(.*?)^## ", README.read_text(), re.S | re.M)
    assert section is not None, "README.md has no Architecture section"
    for unit, paths in kreld_units().items():
        if unit == "__init__":
            continue
        shown = f"`{unit}/`" if paths[0].parent != KRELD else f"`{unit}.py`"
        assert shown in section.group(1), f"README's Architecture section does not name {shown}"


def test_every_module_says_what_it_exports() -> None:
    """``__all__`` on every module (the folders' ``__init__`` files only describe),
    naming only what the module defines or imports."""
    for path in sorted(KRELD.rglob("*.py")):
        if path.name == "__init__.py" and path.parent != KRELD and path.parent.name != "store":
            continue
        tree = ast.parse(path.read_text())
        exported = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = ast.literal_eval(node.value)
        rel = path.relative_to(KRELD)
        if path == KRELD / "__init__.py":
            continue
        assert exported, f"{rel} has no __all__"
        defined = {
            n.name
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        defined |= {
            t.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        defined |= {
            n.target.id
            for n in ast.walk(tree)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        defined |= {
            (a.asname or a.name).split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        }
        assert set(exported) <= defined, f"{rel} exports names it lacks: {set(exported) - defined}"

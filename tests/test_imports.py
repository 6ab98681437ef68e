"""The import direction README's "Architecture" section describes, enforced.

Each file of ``kreld/`` sits in one layer; a file imports only from its own
layer or the layers below (every import counts, also one inside a function).
The source is read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

KRELD = Path(__file__).resolve().parent.parent / "kreld"
README = KRELD.parent / "README.md"

# The layers, lowest first: README.md's "Architecture" section, in code.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("__init__", "consts", "errors", "heap", "log", "model", "record", "uuids"),
    "pure": (
        "config",
        "ctl_args",
        "ctl_render",
        "elf",
        "elfnote",
        "fleet",
        "interface",
        "options",
        "perfdata",
        "perfinput",
        "perfmatch",
        "perfrecords",
        "queries",
        "reconcile",
        "records",
        "requests",
        "symtab",
        "varlink",
    ),
    "system": ("access", "kallsyms", "kaslr", "kernel", "snapshot", "sources", "sysfs_modules"),
    "store": ("bootsource", "lmdbcheck", "pubstate", "s3", "store", "storelock"),
    "engines": ("publish", "symbols", "tracker"),
    "service": ("bucket", "client", "methods", "perfctl", "server", "service"),
    "entry": ("cli", "daemon"),
}
LAYER_OF = {module: i for i, modules in enumerate(LAYERS.values()) for module in modules}
NAMES = list(LAYERS)


def kreld_files() -> dict[str, list[Path]]:
    """Top-level module name (a package counts as one) -> its source files."""
    out: dict[str, list[Path]] = {}
    for path in sorted(KRELD.rglob("*.py")):
        rel = path.relative_to(KRELD)
        name = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else path.stem
        out.setdefault(name, []).append(path)
    return out


def imports_of(paths: list[Path]) -> set[str]:
    """The kreld modules *paths* import (top-level names), lazily or not."""
    found: set[str] = set()
    modules = set(kreld_files())
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "kreld":
                    names = [f"kreld.{a.name}" for a in node.names]
                else:
                    names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "kreld" and len(parts) > 1:
                    found.add(parts[1] if parts[1] in modules else "__init__")
    return found


def test_every_file_of_kreld_has_a_layer() -> None:
    """A new file is placed in the architecture before it lands."""
    unplaced = sorted(set(kreld_files()) - set(LAYER_OF))
    assert not unplaced, f"add these to LAYERS (and README's Architecture section): {unplaced}"
    assert not sorted(set(LAYER_OF) - set(kreld_files())), "LAYERS names a file that is gone"


def test_imports_go_down_the_layers_never_up() -> None:
    upward = []
    for module, paths in kreld_files().items():
        for imported in imports_of(paths) - {module}:
            if LAYER_OF[imported] > LAYER_OF[module]:
                upward.append(
                    f"{module} ({NAMES[LAYER_OF[module]]}) imports "
                    f"{imported} ({NAMES[LAYER_OF[imported]]})"
                )
    assert not upward, "\n".join(upward)


def test_the_model_imports_nothing_of_kreld_but_consts_errors_and_record() -> None:
    assert imports_of(kreld_files()["model"]) <= {"consts", "errors", "record"}


def test_readers_of_proc_and_sys_never_import_the_store_server_service_or_cli() -> None:
    forbidden = {"store", "server", "service", "cli", "daemon", "tracker", "symbols"}
    for reader in LAYERS["system"]:
        assert not imports_of(kreld_files()[reader]) & forbidden, reader


def test_the_store_never_imports_the_server_and_the_server_never_imports_the_cli() -> None:
    files = kreld_files()
    assert not imports_of(files["store"]) & {"server", "service", "varlink", "cli", "daemon"}
    assert not imports_of(files["server"]) & {"cli", "daemon"}


def test_only_the_entry_points_are_imported_by_nothing_in_kreld() -> None:
    """``cli`` and ``daemon`` are programs: no other file depends on them."""
    files = kreld_files()
    for module, paths in files.items():
        assert not imports_of(paths) & {"cli", "daemon"} - {module}, module


def test_readme_architecture_names_every_file_of_kreld() -> None:
    section = re.search(r"^## Architecture\n(.*?)^## ", README.read_text(), re.S | re.M)
    assert section is not None, "README.md has no Architecture section"
    for module, paths in kreld_files().items():
        if module == "__init__":
            continue
        shown = f"`{module}/`" if paths[0].parent != KRELD else f"`{module}.py`"
        assert shown in section.group(1), f"README's Architecture section does not name {shown}"

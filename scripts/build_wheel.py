#!/usr/bin/env python3
"""Build kreld's wheel from the checkout with the standard library alone.

``pip wheel .`` needs the build backend pyproject.toml names, setuptools, at a
version that reads its PEP 639 ``license = "MIT"`` (77 or later), and with
build isolation the network to fetch it.  A host being installed, a package
build chroot or a CI runner may have neither, and kreld is pure Python: its
wheel is a zip of the package files and a ``.dist-info`` directory.  This
writes that wheel from what pyproject.toml declares (name, version,
dependencies, extras, console scripts, ``[tool.setuptools]`` package
discovery and package data), reproducibly (``SOURCE_DATE_EPOCH`` or 1980
timestamps, sorted entries), so that ``pip install --no-index`` can install it
offline.  ``make install`` uses it.

Usage: scripts/build_wheel.py [--outdir DIR] [SOURCE_DIR]   (prints the path)
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import os
import re
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def packages(src: Path, config: dict[str, Any]) -> list[str]:
    """Packages matched by [tool.setuptools.packages.find] include/exclude."""
    find = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    include = find.get("include", ["*"])
    exclude = find.get("exclude", [])
    found = []
    for init in sorted(src.rglob("__init__.py")):
        rel = init.parent.relative_to(src)
        if any(part.startswith(".") for part in rel.parts):
            continue
        name = ".".join(rel.parts)
        if any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
            fnmatch.fnmatchcase(name, p) for p in exclude
        ):
            found.append(name)
    return found


def package_files(src: Path, config: dict[str, Any]) -> list[str]:
    """Every file of the wheel's purelib part, as archive paths."""
    data = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    files = []
    for pkg in packages(src, config):
        d = src.joinpath(*pkg.split("."))
        patterns = ["*.py", *data.get(pkg, []), *data.get("*", [])]
        for f in sorted(d.iterdir()):
            if f.is_file() and any(fnmatch.fnmatchcase(f.name, p) for p in patterns):
                files.append(f.relative_to(src).as_posix())
    return files


def metadata(src: Path, project: dict[str, Any]) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
    ]
    if "description" in project:
        lines.append(f"Summary: {project['description']}")
    lic = project.get("license")
    if isinstance(lic, str):
        lines.append(f"License: {lic}")
    elif isinstance(lic, dict) and "text" in lic:
        lines.append(f"License: {lic['text']}")
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {dep}; extra == "{extra}"' for dep in deps]
    text = ""
    readme = project.get("readme")
    if isinstance(readme, str) and (src / readme).is_file():
        lines.append("Description-Content-Type: text/markdown")
        text = "\n" + (src / readme).read_text()
    return "\n".join(lines) + "\n" + text


def entry_points(project: dict[str, Any]) -> str:
    scripts = project.get("scripts", {})
    if not scripts:
        return ""
    return "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())


def _digest(data: bytes) -> str:
    raw = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def build(src: Path, outdir: Path) -> Path:
    config = tomllib.loads((src / "pyproject.toml").read_text())
    project = config["project"]
    name, version = _normalize(project["name"]), project["version"]
    dist_info = f"{name}-{version}.dist-info"
    members: list[tuple[str, bytes, int]] = [
        (path, (src / path).read_bytes(), 0o644) for path in package_files(src, config)
    ]
    meta = {
        "METADATA": metadata(src, project),
        "WHEEL": (
            "Wheel-Version: 1.0\nGenerator: kreld scripts/build_wheel.py\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        "entry_points.txt": entry_points(project),
        "top_level.txt": "".join(
            p + "\n" for p in sorted({p.split(".")[0] for p in packages(src, config)})
        ),
    }
    members += [(f"{dist_info}/{k}", v.encode(), 0o644) for k, v in meta.items() if v]
    record = "".join(f"{path},{_digest(data)},{len(data)}\n" for path, data, _ in members)
    record += f"{dist_info}/RECORD,,\n"
    members.append((f"{dist_info}/RECORD", record.encode(), 0o644))

    epoch = max(int(os.environ.get("SOURCE_DATE_EPOCH", "315532800")), 315532800)
    stamp = time.gmtime(epoch)[:6]
    outdir.mkdir(parents=True, exist_ok=True)
    wheel = outdir / f"{name}-{version}-py3-none-any.whl"
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data, mode in members:
            info = zipfile.ZipInfo(path, date_time=stamp)
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    tmp.replace(wheel)
    return wheel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", default=Path(__file__).resolve().parent.parent, type=Path)
    p.add_argument("--outdir", type=Path, default=Path("dist"))
    args = p.parse_args(argv)
    print(build(args.source.resolve(), args.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

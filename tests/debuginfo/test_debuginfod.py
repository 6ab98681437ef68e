"""A real debuginfod, in a network namespace the test makes (loopback only),
serving gcc-built files: kreld's client finds a file through it by build-id,
and a 404, a timeout, a truncated reply, an oversize one (announced, or only
counted) and a file of another build each get their named error and leave
nothing in the cache.  debuginfod will not misbehave on demand, so those come
from a small HTTP server of the test's own in the same namespace; the client
runs there too (tests/support/debuginfod_ns.py, launched with ``unshare -n``)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.debuginfo_elves import build

HERE = Path(__file__).resolve().parent
NS_HELPER = HERE.parent / "support" / "debuginfod_ns.py"
HERE = Path(__file__).resolve().parent


@functools.cache
def namespace_fault() -> str | None:
    """Why this machine cannot run the test, or None."""
    for tool in ("debuginfod", "unshare", "ip", "gcc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (scripts/setup installs debuginfod)"
    cp = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"],
        capture_output=True,
        text=True,
        check=False,
    )
    if cp.returncode != 0:
        return f"cannot make a network namespace here: {cp.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if (fault := namespace_fault()) is not None:
        pytest.skip(fault)
    work = tmp_path_factory.mktemp("debuginfod")
    good = build(work / "served" / "prog", 31)
    wrong = build(work / "wrong.debug", 32)
    (work / "state").mkdir(mode=0o700)
    info = {"good": good, "wrong": wrong, "absent": "ee" * 20}
    (work / "info.json").write_text(json.dumps(info))
    cp = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            str(NS_HELPER),
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "DEBUGINFOD_URLS": ""},
    )
    assert cp.returncode == 0, cp.stderr
    return {"info": info, "work": work, **json.loads(cp.stdout)}


def test_a_file_is_found_through_debuginfod_by_build_id_and_cached(
    outcome: dict[str, Any],
) -> None:
    found, good = outcome["found"], outcome["info"]["good"]
    assert found["origin"] == "debuginfod"
    assert found["source"].endswith(f"/buildid/{good}/debuginfo")
    assert found["cache"] == sorted([f"{good}.debug", f"{good}.from"])
    assert Path(found["path"]).read_bytes() == (outcome["work"] / "served" / "prog").read_bytes()


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("missing", "DebuginfodMissing"),
        ("timeout", "DebuginfodTimeout"),
        ("truncated", "DebuginfodTruncated"),
        ("oversize", "DebuginfodTooLarge"),
        ("endless", "DebuginfodTooLarge"),
        ("wrong", "DebuginfoMismatch"),
    ],
)
def test_each_bad_answer_gets_its_named_error_and_the_cache_is_untouched(
    outcome: dict[str, Any], case: str, error: str
) -> None:
    got = outcome[case]
    assert got["error"] == error, got
    good = outcome["info"]["good"]
    assert got["cache"] == sorted([f"{good}.debug", f"{good}.from"]), got


def test_a_build_no_server_has_is_not_found_saying_what_the_server_answered(
    outcome: dict[str, Any],
) -> None:
    got = outcome["not_found"]
    assert got["error"] == "DebuginfoNotFound"
    assert "404" in got["message"]

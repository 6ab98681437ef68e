"""Boot the installed Debian cloud kernel under QEMU with virtme-ng, run one
shell command in it, and hand back what it printed.

The guest sees the host's root file system read-only (throwaway overlays on
top), so the checkout, its ``.venv`` and ``/boot`` are all there at the same
paths; ``rwdir`` is the one writable host directory.  The command's stdout,
stderr and exit status are written by the guest into files under ``rwdir``
and read back here: the serial console that vng relays mixes the kernel's
and init's output with the command's and can lose the start of a line, so it
is only kept (``console.log``) for diagnosis.

Everything here needs ``scripts/setup-vm`` to have run.  One VM at a time:
a lock file serializes boots across processes.  Always software emulation
(``--disable-kvm``), always under ``timeout``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
ADAPTER_DIR = REPO / "tests/vm/bin"
VENVS = (REPO / ".venv", REPO / ".venv-vm")
REAL_VIRTIOFSD = (Path("/usr/libexec/virtiofsd"), Path("/usr/lib/qemu/virtiofsd"))
SYSMAP_DIR = Path("/var/lib/kreld-vm")
LOCK = Path("/tmp/kreld-vm.lock")
DEFAULT_TIMEOUT = 240.0
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class GuestRun(NamedTuple):
    """One boot: the guest command's exit status, stdout and stderr, and the
    wall time of the whole boot (seconds, from starting vng to its exit)."""

    status: int
    stdout: str
    stderr: str
    elapsed: float


class GuestError(RuntimeError):
    """The guest command never reported back (boot failure or timeout)."""


def _version_key(path: Path) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", path.name)]


# The kernel a test boots unless it names another: Debian bookworm's own 6.1.
# Installing bookworm's 6.12 beside it (scripts/setup-vm does) must not change
# what the existing tests run on, so the series is named, never "the newest".
DEFAULT_SERIES = "6.1"


def find_kernel(series: str | None = None) -> Path | None:
    """The newest installed Debian cloud kernel of *series* (``"6.1"``,
    ``"6.12"``: a release's leading numbers; default :data:`DEFAULT_SERIES`),
    or ``None`` when none is installed.  ``KRELD_VM_KERNEL`` overrides the
    default, not a series a test names."""
    if series is None and os.environ.get("KRELD_VM_KERNEL"):
        return Path(os.environ["KRELD_VM_KERNEL"])
    want = series or DEFAULT_SERIES
    found = sorted(Path("/boot").glob(f"vmlinuz-{want}.*cloud*"), key=_version_key)
    return found[-1] if found else None


def skip_unless_series(series: str) -> Path:
    """The kernel of *series*, or skip (pytest) saying it is not installed."""
    import pytest

    kernel = find_kernel(series)
    if kernel is None:
        pytest.skip(f"no /boot/vmlinuz-{series}.*cloud* installed: run scripts/setup-vm")
    return kernel


def kernel_release(kernel: Path) -> str:
    return kernel.name.removeprefix("vmlinuz-")


def find_vng() -> Path | None:
    for venv in VENVS:
        p = venv / "bin" / "vng"
        if p.exists():
            return p
    w = shutil.which("vng")
    return Path(w) if w else None


def real_system_map(release: str) -> Path | None:
    """The real System.map that scripts/setup-vm took from the -dbg package."""
    p = SYSMAP_DIR / f"System.map-{release}"
    return p if p.is_file() else None


def skip_unless_selected(markexpr: str | None, also_missing: str | None = None) -> None:
    """Skip (pytest) unless the run selected ``-m realkernel`` and a VM can boot here;
    *also_missing* is one more reason of the caller's (a tool its guest needs)."""
    import pytest

    if "realkernel" not in (markexpr or ""):
        pytest.skip("boots a VM (minutes): select with -m realkernel")
    why = missing() or also_missing
    if why:
        pytest.skip(f"{why}: run scripts/setup-vm")


def missing() -> str | None:
    """Why a VM cannot be booted here, or ``None`` if it can."""
    if not shutil.which("qemu-system-x86_64"):
        return "qemu-system-x86_64 is not installed"
    if not any(p.exists() for p in REAL_VIRTIOFSD):
        return "no virtiofsd (qemu-system-x86 7.2 ships /usr/lib/qemu/virtiofsd)"
    if find_kernel() is None:
        return "no /boot/vmlinuz-*cloud* (linux-image-cloud-amd64) is installed"
    if find_vng() is None:
        return "virtme-ng (vng) is not installed"
    if not shutil.which("busybox"):
        return "busybox (busybox-static) is not installed"
    if not os.access(ADAPTER_DIR / "virtiofsd", os.X_OK):
        return f"{ADAPTER_DIR / 'virtiofsd'} is not executable"
    return None


@contextlib.contextmanager
def _one_vm_at_a_time() -> Iterator[None]:
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wrapper(env: Mapping[str, str], out: Path, cwd: Path) -> str:
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return (
        "#!/bin/sh\n"
        "# Written by tests/support/harness.py; runs inside the guest.\n"
        f"{exports}"
        f"cd {shlex.quote(str(cwd))} || exit 125\n"
        f"sh {shlex.quote(str(out / 'command.sh'))} "
        f"</dev/null >{shlex.quote(str(out / 'stdout'))} 2>{shlex.quote(str(out / 'stderr'))}\n"
        "rc=$?\n"
        f"echo $rc >{shlex.quote(str(out / 'status.tmp'))}\n"
        f"mv {shlex.quote(str(out / 'status.tmp'))} {shlex.quote(str(out / 'status'))}\n"
        "sync\n"
        "exit $rc\n"
    )


def run_in_guest(
    command: str,
    rwdir: Path,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cpus: int = 2,
    memory: str = "1G",
    name: str = "run",
    kernel: Path | None = None,
) -> GuestRun:
    """Boot the cloud kernel, run *command* with ``sh`` in the guest (cwd
    *rwdir*), and return its status, stdout, stderr and the boot's wall time.

    *rwdir* must be an existing host directory; the guest may write to it (at
    the same path).  The guest's ``PATH`` starts with the project's virtualenv.
    Raises :class:`GuestError` when the command never reported its status
    (boot failure, or *timeout* seconds passed and the VM was killed).
    """
    why = missing()
    if why:
        raise GuestError(f"cannot boot a VM: {why} (run scripts/setup-vm)")
    kernel = kernel or find_kernel()
    vng = find_vng()
    assert kernel is not None and vng is not None
    rwdir = rwdir.resolve()
    out = rwdir / f".guest-{name}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    genv = {
        "PATH": f"{REPO / '.venv/bin'}:{GUEST_PATH}",
        "KRELD_REPO": str(REPO),
        "KRELD_VENV": str(REPO / ".venv"),
        "RW": str(rwdir),
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    (out / "command.sh").write_text(command + "\n")
    (out / "kernel").write_text(f"{kernel}\n")
    (out / "wrapper.sh").write_text(_wrapper(genv, out, rwdir))
    argv = [
        "timeout",
        "--kill-after=10",
        str(int(timeout)),
        str(vng),
        "--run",
        str(kernel),
        "--disable-kvm",
        "--cpus",
        str(cpus),
        "--memory",
        memory,
        f"--rwdir={rwdir}",
        "--exec",
        f"sh {out / 'wrapper.sh'}",
    ]
    # The guest sees the checkout read-only: byte-compile kreld here, or every
    # import in the guest compiles from source (slow under emulation).
    subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "compileall", "-q", str(REPO / "kreld")],
        capture_output=True,
        check=False,
    )
    host_env = dict(os.environ)
    host_env["PATH"] = f"{ADAPTER_DIR}:{vng.parent}:{host_env.get('PATH', '/usr/bin:/bin')}"
    console = out / "console.log"
    with _one_vm_at_a_time(), open(console, "wb") as con:
        start = time.monotonic()
        try:
            cp = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=con,
                stderr=subprocess.STDOUT,
                env=host_env,
                cwd=rwdir,
                timeout=timeout + 30,
                check=False,
            )
            vng_rc: int | str = cp.returncode
        except subprocess.TimeoutExpired:
            vng_rc = "timeout"
        elapsed = time.monotonic() - start
    status_file = out / "status"
    if not status_file.exists():
        tail = console.read_text(errors="replace")[-3000:]
        what = "timed out" if vng_rc in (124, 137, "timeout") else f"exited {vng_rc}"
        raise GuestError(
            f"the guest command never reported a status: vng {what} after {elapsed:.1f}s "
            f"(limit {timeout:.0f}s)\n--- console tail ({console}) ---\n{tail}"
        )
    return GuestRun(
        int(status_file.read_text().strip()),
        (out / "stdout").read_text(errors="replace"),
        (out / "stderr").read_text(errors="replace"),
        elapsed,
    )

"""Readers of the running kernel, all under ``--root``, each file read within
a bound of its kind and every number range-checked where it is parsed
(``files``): boot-id, release,
sysctls and build-id (``info``), ``/proc/kallsyms`` (``kallsyms``), the
loaded modules in sysfs and ``/proc/modules`` (``modules_sysfs``), the KASLR
offset (``kaslr``), ELF files and notes (``elf``, ``notes``), a module's ``.ko``
file, compressed or not, and its symbol table (``modfile``), and one boot's
snapshot put together from them (``snapshot``).  Where ``kptr_restrict=2``
zeroes those, kernel memory: ``/proc/kcore`` (``kcore``), the types' layouts
from BTF (``btf``, and ``module_struct`` for ``struct module``), the module
list walked there (``modules_kcore``), the kernel's own kallsyms tables
decoded there where no System.map is at hand (``memkallsyms``), what of it is believed
(``seethrough``), and how a module's addresses are read now, sysfs or kernel
memory opened when first needed (``addresses``).  Kernel code beyond the
image and modules: perf's side-band records (``sideband``) read live from one
ring per CPU (``perfring``), and what bpf(2) says of each program
(``bpfinfo``); module loads and frees from the module tracepoints, on the same
rings (``modtrace``).  A socket peer's credentials and groups, for the
server's access checks (``peers``).  Where a file (the store's map) is mapped
in kreld's own memory (``selfmaps``).

They never write, and never know of the store or the server.
May import: ``core``, ``config``.
"""

__all__: list[str] = []  # a folder: import its modules by name

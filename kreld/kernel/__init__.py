"""Readers of the running kernel, all under ``--root``: boot-id, release,
sysctls and build-id (``info``), ``/proc/kallsyms`` (``kallsyms``), the sysfs
module directories and ``/proc/modules`` (``modules``), the KASLR offset
(``kaslr``), ELF files and notes (``elf``, ``notes``), and one boot's snapshot
put together from them (``snapshot``).  Where ``kptr_restrict=2`` zeroes
those, kernel memory: ``/proc/kcore`` (``kcore``), the types' layouts from BTF
(``btf``, ``modlayout``), the module list walked there (``kmodules``),
what of it is believed (``seethrough``), and how a module's addresses are
read now, sysfs or kernel memory opened when first needed (``addresses``).

They never write, and never know of the store or the server.
May import: ``core``, ``config``.
"""

__all__: list[str] = []  # a folder: import its modules by name

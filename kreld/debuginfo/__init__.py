"""Debug files of a kernel build, found by build-id and never taken on trust.

``places`` says where a distribution puts the debug file of the kernel image
or of a module (Debian/Ubuntu, Fedora and ``.build-id/`` layouts, each under a
search root: ``--debuginfo-dir``, ``/usr/lib/debug`` under ``--root``,
``[kernel] debuginfo_dirs``); ``fetch`` asks debuginfod servers for one, with
every download bounded in time and size; ``cache`` keeps what was fetched (or
unpacked from a ``.ko.xz``/``.ko.zst`` by ``unpack``) under the state directory, written
privately and renamed into place; ``finder`` puts them together and answers a
checked local path with where it came from.  Source lines with their inline
chains are read from the DWARF of such a file by ``lines_build`` (a module's
sections placed and its DWARF relocated first by ``lines_reloc``) into the
tables of ``lines`` (with the lines of code no DWARF function gives one
from its units' line programs: ``lines_program`` chooses the units,
``lines_dwarf`` decodes them, ``lines_ranges`` makes their rows address
ranges, ``lines_later`` reads the units of gcc's merged functions and of
``.cold`` parts when first asked, ``lines_scopes`` names the inlined frames
symbolic drops there from the DIEs), which the store keeps; the DWARF reader runs in a
process of its own under a memory bound (``lines_child``, started and
waited for by ``lines_spawn``; two at once on halves of a large file's units,
whose SymCaches ``symcache`` reads and merges).  Every file's GNU build-id is read
(:func:`kreld.kernel.elf.fd_build_id`) before it is used or kept: a file of
another build is refused.

Nothing on the record-time path reaches this folder: reading DWARF is for
answering, never for recording (tests/project/test_imports.py holds it).

May import: ``core``, ``config``, ``kernel``.
"""

__all__: list[str] = []  # a folder: import its modules by name

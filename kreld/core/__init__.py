"""The base every folder stands on: paths, defaults and kernel constants
(``consts``), the error family (``errors``), the frozen record (``record``), the
data model (``model``), the packed symbol table (``symtab``), boot-id
conversion (``uuids``), logging (``log``) and the heap's tuning (``heap``).

Imports nothing of kreld outside this folder.
"""

__all__: list[str] = []  # a folder: import its modules by name

"""The base every folder stands on: paths, defaults and kernel constants
(``consts``), the error family and the exit codes (``errors``), the frozen
record (``record``), the data model of boots and modules (``model``) and of
kernel code beyond them (``kernel_code``), the packed symbol table
(``symtab``), boot-id conversion (``uuids``), logging (``log``), the heap's
tuning (``heap``), the one supervisor every thread and task runs under
(``supervise``), the threads' stop flag that wakes their blocked waits
(``stopping``), bounded readers of someone else's JSON (``jsonin``) and
text (``textin``), and files written safely for whoever runs kreldctl
(``safeout``).

Imports nothing of kreld outside this folder.
"""

__all__: list[str] = []  # a folder: import its modules by name

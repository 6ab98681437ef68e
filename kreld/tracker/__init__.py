"""Following what the kernel loads and unloads.  Modules: the event sources
that hint a change (``sources``: kernel uevents, a watchdog observer of
sysfs; and the module tracepoints, read as they come: ``modevents``), the
pure plan of what one look at ``sys/module`` changes
(``modules_plan``), and the tracker that looks, applies the plan to the store
and tells subscribers (``modules``).  Kernel code beyond them, the same way:
the pure plan of what side-band records and a look at kallsyms change
(``kernel_code_plan``), and the follower that reads the rings and applies it
(``kernel_code``).

May import: ``core``, ``config``, ``kernel``, ``store``.
"""

__all__: list[str] = []  # a folder: import its modules by name

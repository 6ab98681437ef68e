"""Following module loads and unloads: the event sources that hint a change
(``sources``: kernel uevents, a watchdog observer of sysfs), the pure plan of
what one look at ``sys/module`` changes (``reconcile``), and the tracker that
looks, applies the plan to the store and tells subscribers (``tracker``).

May import: ``core``, ``config``, ``kernel``, ``store``.
"""

__all__: list[str] = []  # a folder: import its modules by name

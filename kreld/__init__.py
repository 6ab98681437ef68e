"""kreld: a per-host record of where the kernel and its modules were loaded.

The daemon (``kreld``) snapshots the running kernel on every boot, follows
module loads and unloads, and keeps every boot and module incarnation in an
LMDB store; ``kreldctl`` inspects that store and resolves addresses.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"

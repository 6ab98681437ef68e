"""The varlink protocol, pure: the wire format (``wire``: NUL-ended JSON
messages, calls and replies), the interface description parsed once
(``interface``; the IDL itself is ``kreld/io.kreld.varlink``), and each call's
parameters turned into a typed request checked against it (``requests``).

No sockets here: the server and the client both use it.
May import: ``core``.
"""

__all__: list[str] = []  # a folder: import its modules by name

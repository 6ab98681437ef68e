"""perf.data: its formats and the facts they carry (``formats``), the header
reader (``reader``) and its bounded input, a file or a pipe (``input``),
finding the boot and loads a recording was made on (``match``),
``export``/``symbolize --for perf.data`` (``commands``), and ``kreldctl
inject`` (``inject``: the records ``synth`` builds, placed by ``rewrite`` in
a copy of the recording, read in chunks, the records' times from ``inner``).

May import everything below ``server`` and ``server`` itself.
"""

__all__: list[str] = []  # a folder: import its modules by name

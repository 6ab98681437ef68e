"""perf.data: its formats and the facts they carry (``records``), the header
reader (``reader``), finding the boot and loads a recording was made on
(``match``), and ``export``/``symbolize --for perf.data`` (``commands``).

May import everything below ``server`` and ``server`` itself.
"""

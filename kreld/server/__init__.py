"""Answering on the Unix socket: the transport-free ``Service`` that answers
every ``io.kreld`` method from a boot source (``service``), the one method
table (``methods``), the asyncio varlink server with its limits
(``listener``), one connection with its bounded, deadlined writes (``conn``),
the socket file bound safely (``socketfile``), who may connect
(``access``: the policy and SO_PEERCRED), the sd_notify messages to
systemd, sent without ever waiting (``sdnotify``), the background
builder of the line tables Resolve's lines come from (``linebuild``), and
the worker thread's freed heap given back once its calls stop
(``heapback``).

May import: ``core``, ``config``, ``kernel``, ``store``, ``varlink``,
``symbols``, ``tracker``.
"""

__all__: list[str] = []  # a folder: import its modules by name

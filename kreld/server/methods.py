"""The method table: every varlink method kreld serves, written once.

Each :class:`Method` names its typed request (:mod:`kreld.varlink.requests`), the
:class:`~kreld.server.service.Service` code that answers it, and whether the server
may answer it on its event loop (from memory, in microseconds) or hands it
to its worker thread.  ``Subscribe`` streams, so the server carries it out
itself.  The server (:mod:`kreld.server.listener`) and the in-process readers
(``kreldctl`` on a store or a bucket) all dispatch through :data:`METHODS`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kreld import __version__
from kreld.core import consts
from kreld.core.errors import InterfaceNotFound, MethodNotFound, MethodNotImplemented
from kreld.core.record import record
from kreld.server.service import Reply, Service
from kreld.varlink.interface import INTERFACES
from kreld.varlink.requests import (
    ExportKallsyms,
    GetBoot,
    GetInfo,
    GetInterfaceDescription,
    GetKernelCode,
    GetModules,
    ListBoots,
    Request,
    Resolve,
    Snapshot,
    Status,
    Subscribe,
    parse,
)
from kreld.varlink.wire import INTERFACE, SERVICE

__all__ = ["METHODS", "QUICK_RESOLVE", "Method", "Params", "answer", "call", "lookup"]

QUICK_RESOLVE = 64  # addresses a Resolve of the current boot may ask on the loop

Params = Mapping[str, Any]


def _never(_p: Params, _s: Service) -> bool:
    return False


def _current_boot(p: Params, _s: Service) -> bool:
    return not p.get("boot_id")


def _quick_modules(p: Params, _s: Service) -> bool:
    return not (p.get("boot_id") or p.get("all") or p.get("at") is not None)


def _quick_resolve(p: Params, s: Service) -> bool:
    addrs = p.get("addresses")
    return (
        not p.get("boot_id")
        and p.get("at") is None
        and not p.get("lines")  # may wait for a line table's build
        and isinstance(addrs, list)
        and len(addrs) <= QUICK_RESOLVE
    )


def _get_info(_s: Service, _r: GetInfo) -> Reply:
    return {
        "vendor": "kreld",
        "product": "kreld",
        "version": __version__,
        "url": consts.PROJECT_URL,
        "interfaces": [SERVICE, INTERFACE],
    }


def _describe(_s: Service, r: GetInterfaceDescription) -> Reply:
    iface = INTERFACES.get(r.interface)
    if iface is None:
        raise InterfaceNotFound(r.interface)
    return {"description": iface.description}


@record
class Method:
    request: type[Request]
    # The answer, from the service and the typed request; None: the method
    # streams, and the server carries it out.
    handler: Callable[[Service, Any], Reply] | None
    # Whether a call (its parameters as sent) is answered on the event loop,
    # given the service's state.
    quick: Callable[[Params, Service], bool] = _never
    # Answered at once while the daemon starts; the others wait a little for
    # the start (consts.STARTING_WAIT), then answer from what is recorded or
    # say NotReady.
    while_starting: bool = False

    @property
    def name(self) -> str:
        return f"{self.request.INTERFACE}.{self.request.METHOD}"

    @property
    def streaming(self) -> bool:
        return self.handler is None


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(GetInfo, _get_info, _current_boot, while_starting=True),
        Method(GetInterfaceDescription, _describe, _current_boot, while_starting=True),
        Method(GetBoot, Service.get_boot, _current_boot),
        Method(ListBoots, Service.list_boots),
        Method(Snapshot, Service.snapshot),
        Method(GetModules, Service.get_modules, _quick_modules),
        Method(GetKernelCode, Service.get_kernel_code),
        Method(Resolve, Service.resolve, _quick_resolve),
        Method(ExportKallsyms, Service.export_kallsyms),
        Method(Status, Service.status, _current_boot, while_starting=True),
        Method(Subscribe, None),
    )
}


def lookup(qualified: str) -> Method:
    """The method a call names, or the named error saying why there is none."""
    m = METHODS.get(qualified)
    if m is None:
        interface = qualified.rpartition(".")[0]
        if interface not in INTERFACES:
            raise InterfaceNotFound(interface)
        raise MethodNotFound(qualified)
    return m


def answer(service: Service, method: Method, params: Params) -> Reply:
    """Parse *params* as *method*'s request and answer it; errors are raised."""
    if method.handler is None:
        raise MethodNotImplemented(method.name)
    return method.handler(service, parse(method.request, params))


def call(service: Service, name: str, params: Params) -> dict[str, Any]:
    """Method *name* of ``io.kreld`` answered in process, as a plain dict."""
    out = answer(service, lookup(f"{INTERFACE}.{name}"), params)
    return json.loads(out) if isinstance(out, bytes) else out

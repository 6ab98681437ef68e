"""The configuration file: ``kreld.toml`` plus drop-ins, validated strictly.

Unknown keys, wrong types and out-of-range values are :class:`ConfigError`
naming the file and the key: a typo must not silently fall back to a default.
Every value is bounded (strings without NUL bytes, paths within PATH_MAX, the
socket within ``sun_path``, lists, numbers, URLs that name a host), and so is
the reading that comes before: the files (:mod:`kreld.config.files`) and the
text's shape (:mod:`kreld.config.shape`), both checked before tomllib parses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kreld.config.files import Budget, dropins, read_file
from kreld.core import consts
from kreld.core.errors import ConfigError
from kreld.core.record import field, fields, record, replace

__all__ = [
    "RESTART_KEYS",
    "SCHEMA",
    "Config",
    "Limits",
    "http_url_fault",
    "load_bytes",
    "load_config",
    "socket_path_fault",
]

_WATCH_METHODS = ("auto", "poll", "inotify")
# Bounds of a value: characters in a string, bytes in a path (PATH_MAX is 4,096
# with its NUL, include/uapi/linux/limits.h), entries in a list.
_MAX_TEXT = 4096
_MAX_PATH = 4095
_MAX_LIST = 1024
# S3 bucket names: 3 to 63 lowercase letters, digits, dots and hyphens.
_BUCKET = r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
_HOST = r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?"
# Marks a setting SIGHUP cannot change: it takes effect at the next start.
_RESTART = {"restart": True}


@record
class Limits:
    """What one peer may cost the server: the ``[limits]`` section, named and
    defaulted here alone.  :class:`Config` holds them (it derives from this
    record), and the server takes this record of them
    (:func:`kreld.server.listener.limits_of`)."""

    max_message_bytes: int = consts.DEFAULT_MAX_MESSAGE_BYTES
    max_connections: int = consts.DEFAULT_MAX_CONNECTIONS
    max_connections_per_uid: int = consts.DEFAULT_MAX_CONNECTIONS_PER_UID
    cap_root: bool = consts.DEFAULT_CAP_ROOT
    idle_timeout: float = consts.DEFAULT_IDLE_TIMEOUT
    write_timeout: float = consts.DEFAULT_WRITE_TIMEOUT
    subscribe_queue: int = consts.DEFAULT_SUBSCRIBE_QUEUE

    @classmethod
    def of(cls, cfg: Limits) -> Limits:
        """The limits of a configuration, as a record of their own."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@record
class Config(Limits):
    state_dir: str = field(default=consts.DEFAULT_STATE_DIR, metadata=_RESTART)
    socket: str = field(default=consts.DEFAULT_SOCKET, metadata=_RESTART)
    root: str = field(default=consts.DEFAULT_ROOT, metadata=_RESTART)
    debuginfo_dirs: tuple[str, ...] = field(default=(), metadata=_RESTART)
    debuginfod_urls: tuple[str, ...] = ()
    debuginfod_timeout: float = consts.DEFAULT_DEBUGINFOD_TIMEOUT
    debuginfod_max_time: float = consts.DEFAULT_DEBUGINFOD_MAX_TIME
    debuginfod_max_bytes: int = consts.DEFAULT_DEBUGINFOD_MAX_BYTES
    debuginfo_cache_bytes: int = consts.DEFAULT_DEBUGINFO_CACHE_BYTES
    line_build_memory: int = consts.DEFAULT_LINE_BUILD_MEMORY
    follow_code: bool = field(default=True, metadata=_RESTART)
    poll_interval: float = consts.DEFAULT_POLL_INTERVAL
    poll_interval_events: float = consts.DEFAULT_POLL_INTERVAL_EVENTS
    heartbeat_interval: float = consts.HEARTBEAT_INTERVAL
    tracepoints: bool = field(default=True, metadata=_RESTART)
    watch: str = field(default="auto", metadata=_RESTART)
    uevents: bool = field(default=True, metadata=_RESTART)
    socket_group: str = field(default="kreld", metadata=_RESTART)
    allowed_groups: tuple[str, ...] = ("kreld",)
    allowed_uids: tuple[int, ...] = ()
    keep_boots: int = 0
    keep_days: float = 0.0
    log_level: str = "info"
    log_format: str = "auto"
    publish_url: str = ""
    publish_endpoint: str = ""
    publish_interval: float = consts.DEFAULT_PUBLISH_INTERVAL
    sources: tuple[str, ...] = field(default=(), compare=False)


# The settings a reload keeps as they were (the daemon says which need a restart).
RESTART_KEYS = tuple(f.name for f in fields(Config) if f.metadata.get("restart"))


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise TypeError("a non-empty string")
    if "\0" in v:
        raise ValueError("a string without NUL bytes")
    if len(v) > _MAX_TEXT:
        raise ValueError(f"a string of at most {_MAX_TEXT} characters")
    return v


def _abs_path(v: Any) -> str:
    s = _str(v)
    if not s.startswith("/"):
        raise ValueError("an absolute path")
    if len(s.encode()) > _MAX_PATH:
        raise ValueError(f"a path of at most {_MAX_PATH} bytes (PATH_MAX)")
    return s


def socket_path_fault(path: str) -> str | None:
    """Why *path* cannot be kreld's socket (too long for ``sun_path``), or None."""
    size = len(os.fsencode(path))
    if size <= consts.MAX_SOCKET_PATH:
        return None
    return (
        f"a socket path of at most {consts.MAX_SOCKET_PATH} bytes (a Unix socket's address"
        f" holds 107, and kreld binds under a name up to 9 bytes longer); this one has {size}"
    )


def _socket_path(v: Any) -> str:
    s = _abs_path(v)
    if (fault := socket_path_fault(s)) is not None:
        raise ValueError(fault)
    return s


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"a list of {what}")
    if len(v) > _MAX_LIST:
        raise ValueError(f"a list of at most {_MAX_LIST} {what}")
    return v


def _paths(v: Any) -> tuple[str, ...]:
    return tuple(_abs_path(x) for x in _list(v, "absolute paths"))


def _interval(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError("a number of seconds")
    if not 0.05 <= v <= 3600:  # compared as they are: float() of 10**400 overflows
        raise ValueError("between 0.05 and 3600 seconds")
    return float(v)


def _names(v: Any) -> tuple[str, ...]:
    return tuple(_str(x) for x in _list(v, "group names"))


def _uids(v: Any) -> tuple[int, ...]:
    if not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32
        for x in _list(v, "numeric uids")
    ):
        raise TypeError("a list of numeric uids")
    return tuple(v)


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError("an integer")
        if not lo <= v <= hi:
            raise ValueError(f"an integer from {lo} to {hi}")
        return v

    return check


def _seconds(lo: float, hi: float) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError("a number of seconds")
        if not lo <= v <= hi:
            raise ValueError(f"between {lo} and {hi} seconds")
        return float(v)

    return check


def _days(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError("a number of days")
    if not 0 <= v <= 100_000:
        raise ValueError("between 0 (keep forever) and 100000 days")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("true or false")
    return v


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError("one of " + ", ".join(repr(c) for c in choices))
        return str(v)

    return check


def _url_text(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise TypeError(what)
    if len(v) > _MAX_TEXT or any(c <= " " or c == "\x7f" for c in v):
        raise ValueError(f"{what}, without spaces or control characters")
    return v


def _s3_url(v: Any) -> str:
    what = "s3://BUCKET/PREFIX (empty: publishing off)"
    url = _url_text(v, what)
    bucket = url[5:].split("/", 1)[0]
    if url and (not url.startswith("s3://") or not re.fullmatch(_BUCKET, bucket)):
        raise ValueError(f"{what}, BUCKET being 3 to 63 of a-z, 0-9, '.' and '-'")
    return url


def _http_url(v: Any) -> str:
    what = "an http:// or https:// URL with a host (empty: from the environment)"
    url = _url_text(v, what)
    if url and (fault := http_url_fault(url)) is not None:
        raise ValueError(f"{what}: {fault}")
    return url


def _http_urls(v: Any) -> tuple[str, ...]:
    what = "http:// or https:// URLs with a host"
    urls = tuple(_url_text(x, what) for x in _list(v, what))
    for url in urls:
        if (fault := http_url_fault(url)) is not None:
            raise ValueError(f"{what}: {url!r}: {fault}")
    return urls


def http_url_fault(url: str) -> str | None:
    """What is wrong with *url* as an object storage endpoint, or None."""
    from urllib.parse import urlsplit  # only for an endpoint_url that is set

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not a number from 0 to 65535
        host = parts.hostname or ""
        if ":" in host:
            import ipaddress

            ipaddress.IPv6Address(host)
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return f"the scheme is {parts.scheme!r}"
    if not host or (":" not in host and not re.fullmatch(_HOST, host)):
        return "no host" if not host else f"{host!r} is not a host name"
    if port == 0:
        return "port 0"
    if parts.username is not None or parts.password is not None:
        return "a user name or password in the URL (URLs are logged: keep secrets out)"
    if parts.query or parts.fragment:
        return "a query or fragment"
    return None


# section -> key -> (Config attribute, validator)
SCHEMA: Mapping[str, Mapping[str, tuple[str, Callable[[Any], Any]]]] = {
    "paths": {
        "state_dir": ("state_dir", _abs_path),
        "socket": ("socket", _socket_path),
        "root": ("root", _abs_path),
    },
    "kernel": {
        "debuginfo_dirs": ("debuginfo_dirs", _paths),
        "follow_code": ("follow_code", _bool),
        "debuginfod_urls": ("debuginfod_urls", _http_urls),
        "debuginfod_timeout": ("debuginfod_timeout", _seconds(0.1, 3600)),
        "debuginfod_max_time": ("debuginfod_max_time", _seconds(1, 86400)),
        "debuginfod_max_bytes": ("debuginfod_max_bytes", _int_range(1 << 20, 1 << 40)),
        "debuginfo_cache_bytes": ("debuginfo_cache_bytes", _int_range(0, 1 << 44)),
        "line_build_memory": ("line_build_memory", _int_range(64 << 20, 1 << 44)),
    },
    "modules": {
        "poll_interval": ("poll_interval", _interval),
        "poll_interval_events": ("poll_interval_events", _interval),
        "heartbeat_interval": ("heartbeat_interval", _seconds(0.1, 3600)),
        "tracepoints": ("tracepoints", _bool),
        "watch": ("watch", _choice(*_WATCH_METHODS)),
        "uevents": ("uevents", _bool),
    },
    "access": {
        "socket_group": ("socket_group", _str),
        "allowed_groups": ("allowed_groups", _names),
        "allowed_uids": ("allowed_uids", _uids),
    },
    "limits": {
        "max_message_bytes": ("max_message_bytes", _int_range(1024, 1 << 30)),
        "max_connections": ("max_connections", _int_range(1, 65536)),
        "max_connections_per_uid": ("max_connections_per_uid", _int_range(1, 65536)),
        "cap_root": ("cap_root", _bool),
        "idle_timeout": ("idle_timeout", _seconds(0.1, 86400)),
        "write_timeout": ("write_timeout", _seconds(0.1, 86400)),
        "subscribe_queue": ("subscribe_queue", _int_range(1, 1 << 20)),
    },
    "retention": {
        "keep_boots": ("keep_boots", _int_range(0, 1 << 31)),
        "keep_days": ("keep_days", _days),
    },
    "publish": {
        "url": ("publish_url", _s3_url),
        "endpoint_url": ("publish_endpoint", _http_url),
        "interval": ("publish_interval", _seconds(0.05, 86400)),
    },
    "log": {
        "level": ("log_level", _choice(*consts.LOG_LEVELS)),
        "format": ("log_format", _choice(*consts.LOG_FORMATS)),
    },
}


def _shown(value: Any) -> str:
    """*value* as an error message shows it: bounded in length and depth."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 160, 160, 8, 8
    return r.repr(value)


def _key(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _apply(cfg: Config, data: Mapping[str, Any], file: str) -> Config:
    changes: dict[str, Any] = {}
    for section, table in data.items():
        keys = SCHEMA.get(section)
        if keys is None:
            raise ConfigError(
                file, f"unknown section (known: {', '.join(SCHEMA)})", f"[{_key(section)}]"
            )
        if not isinstance(table, dict):
            raise ConfigError(file, "must be a table", f"[{section}]")
        for key, value in table.items():
            spec = keys.get(key)
            if spec is None:
                raise ConfigError(
                    file,
                    f"unknown key (known in [{section}]: {', '.join(keys)})",
                    f"{section}.{_key(key)}",
                )
            attr, check = spec
            try:
                changes[attr] = check(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(
                    file, f"expected {e}, got {_shown(value)}", f"{section}.{key}"
                ) from e
    return replace(cfg, **changes, sources=(*cfg.sources, file))


def _only_comments(raw: bytes) -> bool:
    """Whether *raw* is plainly an empty TOML document: blank lines and
    printable ``#`` comments only (anything else goes to the parser)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    for line in text.splitlines():
        line = line.strip(" \t")
        if line and not (line.startswith("#") and line.replace("\t", " ").isprintable()):
            return False
    return True


def _parse(raw: bytes, file: str) -> dict[str, Any]:
    if _only_comments(raw):
        return {}  # the packaged file, all comments: no need to load tomllib
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(file, f"not valid TOML: not UTF-8 (byte {e.start}, line {line})") from e
    from kreld.config.shape import check_shape

    check_shape(text, file)
    import tomllib  # with datetime: only when there is a file with settings

    try:
        return tomllib.loads(text)
    except ValueError as e:
        # TOMLDecodeError carries "(at line N, column M)"; a plain ValueError is an
        # integer of more digits than Python converts (sys.get_int_max_str_digits),
        # whose advice to raise that limit is for programmers.
        raise ConfigError(file, f"not valid TOML: {str(e).split('; use ')[0]}") from e


def load_bytes(raw: bytes, file: str, base: Config | None = None) -> Config:
    """*base* (the defaults) with the settings of the TOML document *raw*, named *file*
    in errors: a :class:`Config`, or a :class:`ConfigError` whatever the bytes."""
    return _apply(Config() if base is None else base, _parse(raw, file), file)


def load_config(path: str | None) -> Config:
    """Load *path* (or the default, which may be absent) and its drop-ins.

    Drop-ins are ``<path>.d/*.toml`` applied in name order, each overriding
    what came before.  An explicitly named file that does not exist is an error.
    """
    explicit = path is not None
    main = Path(path if path is not None else consts.DEFAULT_CONFIG)
    cfg = Config()
    budget = Budget()
    if explicit or main.exists():
        cfg = load_bytes(read_file(main, budget), str(main), cfg)
    dropin_dir = main.with_name(main.name + ".d")
    if dropin_dir.is_dir():
        for drop in dropins(dropin_dir):
            cfg = load_bytes(read_file(drop, budget), str(drop), cfg)
    return cfg

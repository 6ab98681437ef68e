"""The configuration file: ``kreld.toml`` plus drop-ins, validated strictly.

Unknown keys, wrong types and out-of-range values are :class:`ConfigError`
naming the file and the key: a typo must not silently fall back to a default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kreld.core import consts
from kreld.core.errors import ConfigError
from kreld.core.record import field, fields, record, replace

__all__ = ["RESTART_KEYS", "SCHEMA", "Config", "load_config"]

_WATCH_METHODS = ("auto", "poll", "inotify")
# Marks a setting SIGHUP cannot change: it takes effect at the next start.
_RESTART = {"restart": True}


@record
class Config:
    state_dir: str = field(default=consts.DEFAULT_STATE_DIR, metadata=_RESTART)
    socket: str = field(default=consts.DEFAULT_SOCKET, metadata=_RESTART)
    root: str = field(default=consts.DEFAULT_ROOT, metadata=_RESTART)
    debuginfo_dirs: tuple[str, ...] = field(default=(), metadata=_RESTART)
    poll_interval: float = consts.DEFAULT_POLL_INTERVAL
    watch: str = field(default="auto", metadata=_RESTART)
    uevents: bool = field(default=True, metadata=_RESTART)
    socket_group: str = field(default="kreld", metadata=_RESTART)
    allowed_groups: tuple[str, ...] = ("kreld",)
    allowed_uids: tuple[int, ...] = ()
    max_message_bytes: int = consts.DEFAULT_MAX_MESSAGE_BYTES
    max_connections: int = consts.DEFAULT_MAX_CONNECTIONS
    idle_timeout: float = consts.DEFAULT_IDLE_TIMEOUT
    subscribe_queue: int = consts.DEFAULT_SUBSCRIBE_QUEUE
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
    return v


def _abs_path(v: Any) -> str:
    s = _str(v)
    if not s.startswith("/"):
        raise ValueError("an absolute path")
    return s


def _paths(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise TypeError("a list of absolute paths")
    return tuple(_abs_path(x) for x in v)


def _interval(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError("a number of seconds")
    if not 0.05 <= float(v) <= 3600:
        raise ValueError("between 0.05 and 3600 seconds")
    return float(v)


def _names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise TypeError("a list of group names")
    return tuple(_str(x) for x in v)


def _uids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in v
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
        if not lo <= float(v) <= hi:
            raise ValueError(f"between {lo} and {hi} seconds")
        return float(v)

    return check


def _days(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError("a number of days")
    if not 0 <= float(v) <= 100_000:
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


def _s3_url(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("a string s3://BUCKET/PREFIX (empty: publishing off)")
    if v and (not v.startswith("s3://") or not v[5:].split("/", 1)[0]):
        raise ValueError("s3://BUCKET/PREFIX (empty: publishing off)")
    return v


def _http_url(v: Any) -> str:
    if not isinstance(v, str) or (v and not v.startswith(("http://", "https://"))):
        raise ValueError("an http:// or https:// URL, or empty")
    return v


# section -> key -> (Config attribute, validator)
SCHEMA: Mapping[str, Mapping[str, tuple[str, Callable[[Any], Any]]]] = {
    "paths": {
        "state_dir": ("state_dir", _abs_path),
        "socket": ("socket", _abs_path),
        "root": ("root", _abs_path),
    },
    "kernel": {
        "debuginfo_dirs": ("debuginfo_dirs", _paths),
    },
    "modules": {
        "poll_interval": ("poll_interval", _interval),
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
        "idle_timeout": ("idle_timeout", _seconds(0.1, 86400)),
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


def _apply(cfg: Config, data: Mapping[str, Any], file: str) -> Config:
    changes: dict[str, Any] = {}
    for section, table in data.items():
        keys = SCHEMA.get(section)
        if keys is None:
            raise ConfigError(file, f"unknown section (known: {', '.join(SCHEMA)})", f"[{section}]")
        if not isinstance(table, dict):
            raise ConfigError(file, "must be a table", f"[{section}]")
        for key, value in table.items():
            spec = keys.get(key)
            if spec is None:
                raise ConfigError(
                    file,
                    f"unknown key (known in [{section}]: {', '.join(keys)})",
                    f"{section}.{key}",
                )
            attr, check = spec
            try:
                changes[attr] = check(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(file, f"expected {e}, got {value!r}", f"{section}.{key}") from e
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


def _load_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(str(path), f"cannot read: {e.strerror}") from e
    if _only_comments(raw):
        return {}  # the packaged file, all comments: no need to load tomllib
    import tomllib  # with datetime: only when there is a file with settings

    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"not valid TOML: not UTF-8: {e}") from e
    except tomllib.TOMLDecodeError as e:
        # The message carries "(at line N, column M)".
        raise ConfigError(str(path), f"not valid TOML: {e}") from e


def load_config(path: str | None) -> Config:
    """Load *path* (or the default, which may be absent) and its drop-ins.

    Drop-ins are ``<path>.d/*.toml`` applied in name order, each overriding
    what came before.  An explicitly named file that does not exist is an error.
    """
    explicit = path is not None
    main = Path(path if path is not None else consts.DEFAULT_CONFIG)
    cfg = Config()
    if main.exists() or explicit:
        cfg = _apply(cfg, _load_file(main), str(main))
    dropin_dir = main.with_name(main.name + ".d")
    if dropin_dir.is_dir():
        for drop in sorted(dropin_dir.glob("*.toml")):
            cfg = _apply(cfg, _load_file(drop), str(drop))
    return cfg

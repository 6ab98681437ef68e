"""Object storage through obstore (the optional ``kreld[fleet]`` extra).

obstore (Rust's ``object_store``, docs/FLEET.md says why it over boto3) is imported only
here, and only when a bucket is opened: a kreld without the extra runs as before, and
refuses a ``[publish]`` section with a :class:`~kreld.core.errors.ConfigError`.

Credentials and region: obstore reads the standard ``AWS_*`` variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
``AWS_ENDPOINT_URL``, web identity, ECS and instance metadata); when the environment names
no key, the static keys and region of the profile ``AWS_PROFILE`` (default ``default``) in
the shared files ``~/.aws/credentials`` and ``~/.aws/config`` (or ``AWS_SHARED_CREDENTIALS_FILE``,
``AWS_CONFIG_FILE``) are used.  No credential is ever logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import configparser
import os
import re
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kreld.core.errors import ConfigError, FleetError, FleetObjectInvalid

if TYPE_CHECKING:
    from obstore.store import ObjectStore

__all__ = [
    "CONCURRENCY",
    "EXTRA_HINT",
    "Bucket",
    "describe",
    "missing_reason",
    "open_bucket",
    "require_fleet",
    "split_url",
]

EXTRA_HINT = "install kreld with the fleet extra: pip install 'kreld[fleet]' (obstore)"
_ECHOED = re.compile(
    r"<(AWSAccessKeyId|StringToSign|StringToSignBytes|SignatureProvided|CanonicalRequest"
    r"|CanonicalRequestBytes)>.*?</\1>"
)
# Keys read from the shared files, kept out of messages like those of the environment.
_FROM_FILES: set[str] = set()
# Requests in flight at once when a reader fetches many objects.
CONCURRENCY = 64
# What one GET may bring unless the caller says (the largest object kreld writes is a
# symbol table, refused past kreld.fleet.objects.MAX_TABLE), and the pieces it comes in.
DEFAULT_LIMIT = 64 << 20
_CHUNK = 1 << 20
Fetched = bytes | None | FleetObjectInvalid


def missing_reason() -> str | None:
    """Why object storage cannot be used here (the extra is missing), or None."""
    try:
        import obstore
        import obstore.store  # noqa: F401
    except ImportError as e:
        return f"obstore cannot be imported ({e})"
    return None


def require_fleet(file: str) -> None:
    """A :class:`ConfigError` naming ``publish.url`` when the extra is missing."""
    reason = missing_reason()
    if reason is not None:
        raise ConfigError(
            file, f"publishing needs object storage support: {reason}; {EXTRA_HINT}", "publish.url"
        )


def split_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix without slashes at its ends)."""
    if not url.startswith("s3://"):
        raise FleetError(url, "not an s3://BUCKET/PREFIX URL")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise FleetError(url, "no bucket in the URL")
    return bucket, prefix.strip("/")


def _shared_profile() -> dict[str, str]:
    """Static keys and region of the AWS profile in the shared files, when the
    environment names no key (obstore itself reads only the environment)."""
    out: dict[str, str] = {}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return out
    profile = os.environ.get("AWS_PROFILE") or "default"
    home = Path.home()
    creds_file = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or str(home / ".aws/credentials")
    config_file = os.environ.get("AWS_CONFIG_FILE") or str(home / ".aws/config")
    sections = (
        (creds_file, profile),
        (config_file, profile if profile == "default" else f"profile {profile}"),
    )
    for path, section in sections:
        cp = configparser.RawConfigParser()
        try:
            cp.read(path)
        except (OSError, configparser.Error):
            continue
        if not cp.has_section(section):
            continue
        for name, key in (
            ("aws_access_key_id", "access_key_id"),
            ("aws_secret_access_key", "secret_access_key"),
            ("aws_session_token", "token"),
            ("region", "region"),
        ):
            value = cp.get(section, name, fallback=None)
            if value and key not in out:
                out[key] = value
    if "region" in out and (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        del out["region"]
    return out


def describe(e: BaseException) -> str:
    """An obstore error as one line that says what to check (never a secret)."""
    name = type(e).__name__
    text = " ".join(str(e).split())
    # What a server may echo back of the request's signing, and any key kreld was given.
    text = _ECHOED.sub(r"<\1>(not shown)</\1>", text)
    keys = {os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    keys.add(os.environ.get("AWS_SESSION_TOKEN"))
    for value in keys | _FROM_FILES:
        if value and len(value) >= 4:
            text = text.replace(value, "(not shown)")
    if name in ("PermissionDeniedError", "UnauthenticatedError") or "403 Forbidden" in text:
        hint = "access denied: check the AWS credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE)"
    elif name == "NotFoundError":
        hint = "not found"
    elif "connect" in text.lower() or "timed out" in text.lower() or "dns" in text.lower():
        hint = "storage unreachable"
    elif re.search(r"status code: 5\d\d", text):
        hint = "storage server error"
    else:
        hint = "storage error"
    for marker in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "NoSuchBucket"):
        if marker in text:
            hint += f" ({marker})"
            break
    return f"{hint}: {name}: {text[:300]}"


class Bucket:
    """The few operations kreld needs, with obstore's errors turned into :class:`FleetError`."""

    def __init__(self, store: ObjectStore, url: str) -> None:
        self.store = store
        self.url = url
        self.requests = 0

    def _fail(self, what: str, key: str, e: BaseException) -> FleetError:
        return FleetError(self.url, f"{what} {key}: {describe(e)}")

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes | None:
        """The object *key* (None when absent); one past *limit* bytes is refused
        with :class:`FleetObjectInvalid`, by its listed size before it is read and
        by what arrives while it is read."""
        import obstore
        from obstore.exceptions import NotFoundError

        self.requests += 1
        try:
            res = obstore.get(self.store, key)
            _fits(key, int(res.meta["size"]), limit)
            buf = bytearray()
            for chunk in res.stream(min_chunk_size=_CHUNK):
                buf += chunk
                _fits(key, len(buf), limit)
            return bytes(buf)
        except (NotFoundError, FileNotFoundError):
            return None
        except FleetObjectInvalid:
            raise
        except Exception as e:
            raise self._fail("GET", key, e) from e

    def exists(self, key: str) -> bool:
        import obstore
        from obstore.exceptions import NotFoundError

        self.requests += 1
        try:
            obstore.head(self.store, key)
            return True
        except (NotFoundError, FileNotFoundError):
            return False
        except Exception as e:
            raise self._fail("HEAD", key, e) from e

    def put(self, key: str, data: bytes) -> None:
        import obstore

        self.requests += 1
        try:
            obstore.put(self.store, key, data)
        except Exception as e:
            raise self._fail("PUT", key, e) from e

    def delete(self, keys: Sequence[str]) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        for key in keys:
            self.requests += 1
            try:
                obstore.delete(self.store, key)
            except (NotFoundError, FileNotFoundError):
                pass
            except Exception as e:
                raise self._fail("DELETE", key, e) from e

    def list(self, prefix: str) -> Iterator[str]:
        """Names that start with *prefix*, in order, page by page (S3 returns up to 1000 a
        request).  obstore lists whole path segments, so a partial last segment is
        listed from its directory, starting after it (S3's start-after), until past it."""
        import obstore

        directory, offset = _segments(prefix)
        try:
            for page in obstore.list(self.store, directory, offset=offset, chunk_size=1000):
                self.requests += 1
                for meta in page:
                    name = str(meta["path"])
                    if name.startswith(prefix):
                        yield name
                    elif name > prefix:
                        return
        except Exception as e:
            raise self._fail("LIST", prefix, e) from e

    def get_many(self, keys: Sequence[str], limit: int = DEFAULT_LIMIT) -> dict[str, Fetched]:
        """Many objects fetched concurrently: each its bytes, None when absent, or
        the :class:`FleetObjectInvalid` that refused it (past *limit* bytes), so
        that one oversized object does not cost the others."""
        import obstore
        from obstore.exceptions import NotFoundError

        async def one(key: str, gate: asyncio.Semaphore) -> tuple[str, Fetched]:
            async with gate:
                try:
                    res = await obstore.get_async(self.store, key)
                    _fits(key, int(res.meta["size"]), limit)
                    buf = bytearray()
                    async for chunk in res.stream(min_chunk_size=_CHUNK):
                        buf += chunk
                        _fits(key, len(buf), limit)
                    return key, bytes(buf)
                except (NotFoundError, FileNotFoundError):
                    return key, None
                except FleetObjectInvalid as e:
                    return key, e
                except Exception as e:
                    raise self._fail("GET", key, e) from e

        async def run() -> list[tuple[str, Fetched]]:
            gate = asyncio.Semaphore(CONCURRENCY)
            return list(await asyncio.gather(*(one(k, gate) for k in keys)))

        if not keys:
            return {}
        self.requests += len(keys)
        return dict(asyncio.run(run()))


def _fits(key: str, size: int, limit: int) -> None:
    if size > limit:
        raise FleetObjectInvalid(key, f"{size:,} bytes or more, past the {limit:,} a reader takes")


def _segments(prefix: str) -> tuple[str | None, str | None]:
    """The directory obstore lists for a name prefix, and the name to start after."""
    directory, _, rest = prefix.rpartition("/")
    return directory or None, prefix if rest else None


def open_bucket(url: str, endpoint: str = "", *, timeout: float = 30.0, retries: int = 2) -> Bucket:
    """A :class:`Bucket` for ``s3://BUCKET/PREFIX``; *endpoint*, else ``AWS_ENDPOINT_URL``,
    else the provider's default."""
    reason = missing_reason()
    if reason is not None:
        raise FleetError(url, f"{reason}; {EXTRA_HINT}")
    from obstore.store import S3Store

    bucket, prefix = split_url(url)
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
    config: dict[str, Any] = dict(_shared_profile())
    _FROM_FILES.update(v for k, v in config.items() if k != "region")
    if endpoint:
        config["endpoint"] = endpoint
    if "region" not in config and not (
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    ):
        config["region"] = "us-east-1"
    client: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=min(timeout, 5.0)),
    }
    if endpoint.startswith("http://"):
        client["allow_http"] = True
    retry: dict[str, Any] = {
        "max_retries": retries,
        "retry_timeout": timedelta(seconds=timeout),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
    }
    try:
        store = S3Store(
            bucket,
            prefix=prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
        )
    except Exception as e:
        raise FleetError(url, f"cannot open: {describe(e)}") from e
    return Bucket(store, url)

"""What the S3 backend reads before it talks to a server: ``s3://`` URLs, the client's settings
(``RAVEX_S3_*`` and the standard ``AWS_*`` variables, a run's ``storage.endpoint`` and
``storage.region``), and what its failures mean to a user.

Light on purpose: no compiled core, so that the configuration of a run (``ravex status``
imports no torch and loads no client) can check an ``s3://`` location without a client.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import FileSystemError, RavexError

__all__ = ["ENV", "SCHEME", "client_settings", "configure", "error", "split", "unreachable"]

SCHEME = "s3://"
# the S3 client's own environment variables (docs/storage.md), besides the standard AWS_* ones
ENV = ("RAVEX_S3_ACCESS_KEY", "RAVEX_S3_SECRET_KEY", "RAVEX_S3_ENDPOINT", "RAVEX_S3_PART_MB", "RAVEX_S3_IN_FLIGHT", "RAVEX_S3_READ_AHEAD", "RAVEX_S3_RETRIES",
       "RAVEX_S3_RETRY_TIMEOUT_S", "RAVEX_S3_CONNECT_TIMEOUT_S", "RAVEX_S3_TIMEOUT_S", "RAVEX_S3_LEASE_TTL")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def split(url: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key``: a key is relative, '/'-separated, without
    empty, '.' or '..' segments (a trailing '/' is dropped)."""
    rest = url.removeprefix(SCHEME)
    name, _, key = rest.partition("/")
    if not _BUCKET_NAME.match(name):
        raise RavexError(f"{url}: {name!r} is not an S3 bucket name", hint="write s3://BUCKET/PREFIX (a bucket name is 3-63 lowercase letters, digits, '.' and '-')")
    key = key.rstrip("/")
    if key and any(p in ("", ".", "..") for p in key.split("/")):
        raise RavexError(f"{url}: not an object key (empty, '.' or '..' segments)", hint="write s3://BUCKET/PREFIX with plain names between the slashes")
    return name, key


def env(*names: str) -> str | None:
    """The first of ``names`` set (not empty) in the environment."""
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


def number(name: str, default: float) -> float:
    """A non-negative number from environment variable ``name``."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RavexError(f"{name}={raw!r} is not a number", hint=f"unset {name} or give it a number") from None
    if value < 0:
        raise RavexError(f"{name}={raw!r} must not be negative", hint=f"unset {name} or give it a number >= 0")
    return value


# A lease is renewed every TTL/4: below this a pause of a second or two (a GC, a busy disk) loses it
# to another run, which then takes the store over from a holder that is alive.
MIN_LEASE_TTL_S = 5.0
# A taker waits a lapsed lease out for its holder's TTL: a longer one leaves a lost machine's store
# unusable for longer than any restart should wait (a note's TTL above it is not waited out).
MAX_LEASE_TTL_S = 3600.0


def lease_ttl() -> float:
    """Seconds a lease object may go unrenewed before another writer takes it over."""
    ttl = number("RAVEX_S3_LEASE_TTL", 120.0)
    if ttl < MIN_LEASE_TTL_S:
        raise RavexError(f"RAVEX_S3_LEASE_TTL={os.environ.get('RAVEX_S3_LEASE_TTL')!r} is below {MIN_LEASE_TTL_S:.0f} s: a lease renewed "
                         f"every {ttl / 4:.2f} s is lost to any pause of the holder, and another run takes a live run's store over",
                         hint=f"set RAVEX_S3_LEASE_TTL to {MIN_LEASE_TTL_S:.0f} or more (the default is 120), or unset it")
    if ttl > MAX_LEASE_TTL_S:
        raise RavexError(f"RAVEX_S3_LEASE_TTL={os.environ.get('RAVEX_S3_LEASE_TTL')!r} is above {MAX_LEASE_TTL_S:.0f} s: a replacement "
                         "machine would wait that long for a lost holder's lease to lapse",
                         hint=f"set RAVEX_S3_LEASE_TTL between {MIN_LEASE_TTL_S:.0f} and {MAX_LEASE_TTL_S:.0f} (the default is 120), or unset it")
    return ttl


_configured: dict[str, tuple[str | None, str | None]] = {}  # bucket -> (endpoint, region) a run's configuration gave


def configure(name: str, *, endpoint: str | None = None, region: str | None = None) -> None:
    """Where bucket ``name`` is, as a run's configuration says (``storage.endpoint``,
    ``storage.region``); the environment's values are used where these are None."""
    _configured[name] = (endpoint, region)


def client_settings(name: str) -> dict[str, Any]:
    """The keyword arguments of the core's client of bucket ``name`` (``_core.S3Bucket``), from a
    run's configuration and the environment."""
    given_endpoint, given_region = _configured.get(name, (None, None))
    endpoint = given_endpoint or env("RAVEX_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    access, secret = env("RAVEX_S3_ACCESS_KEY"), env("RAVEX_S3_SECRET_KEY")
    if bool(access) != bool(secret):
        raise RavexError("only one of RAVEX_S3_ACCESS_KEY and RAVEX_S3_SECRET_KEY is set", hint="set both, or neither (then the AWS_* variables are used)")
    region = given_region or env("AWS_REGION", "AWS_DEFAULT_REGION") or ("auto" if endpoint and ".r2.cloudflarestorage.com" in endpoint else "us-east-1")
    return {"endpoint": endpoint, "region": region, "access_key": access, "secret_key": secret,
            "session_token": env("AWS_SESSION_TOKEN") if access is None else None,
            "part_size": int(number("RAVEX_S3_PART_MB", 8) * (1 << 20)), "max_in_flight": int(number("RAVEX_S3_IN_FLIGHT", 8)),
            "read_ahead": int(number("RAVEX_S3_READ_AHEAD", 16)),
            "max_retries": int(number("RAVEX_S3_RETRIES", 10)), "retry_timeout_s": number("RAVEX_S3_RETRY_TIMEOUT_S", 180),
            "connect_timeout_s": number("RAVEX_S3_CONNECT_TIMEOUT_S", 5), "request_timeout_s": number("RAVEX_S3_TIMEOUT_S", 60)}


def client_key(name: str, settings: dict[str, Any]) -> tuple[Any, ...]:
    """One client per process, bucket and settings; the credentials are part of the key only as a hash."""
    secrets = ("access_key", "secret_key", "session_token")
    plain = tuple(sorted((k, v) for k, v in settings.items() if k not in secrets))
    return (os.getpid(), name, plain, hash((*(settings[k] for k in secrets), env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"))))


# ------------------------------------------------------------------------------ failures

# What to do about each kind of S3 failure (``_core.S3Error.kind``).
HINTS = {
    "not_found": "check the path: `ravex inspect s3://BUCKET/PREFIX` lists what is there",
    "denied": "check the credentials (RAVEX_S3_ACCESS_KEY / RAVEX_S3_SECRET_KEY, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) "
              "and that they may read and write this bucket",
    "no_bucket": "create the bucket first, or check its name and AWS_ENDPOINT_URL",
    "unreachable": "check AWS_ENDPOINT_URL (or RAVEX_S3_ENDPOINT) and the network; rerun: nothing half-written is taken for complete",
    "precondition": "another writer changed it meanwhile; rerun",
    "invalid": "this is a path or size S3 cannot hold",
    "other": "rerun; if it persists, check the server's logs",
}
# Buckets whose server stopped answering in this process: cleaning up after the failure is left
# to the next writer, rather than waiting out the same timeouts again. A bucket leaves the set
# when an output begins there again (its server answered).
_unreachable: set[str] = set()


def unreachable(name: str) -> bool:
    """Whether the server of bucket ``name`` stopped answering in this process (since an output last began there)."""
    return name in _unreachable


def answered(name: str) -> None:
    """The server of bucket ``name`` answered again."""
    _unreachable.discard(name)


def error(exc: OSError) -> FileSystemError:
    """An ``S3Error`` of the core as one clear error (exit 9, as any storage that refuses a read
    or a write): the ``s3://`` URL, what happened, a hint."""
    kind = str(getattr(exc, "kind", "other"))
    url = getattr(exc, "url", None)
    if kind == "unreachable" and isinstance(url, str) and url.startswith(SCHEME):
        _unreachable.add(url[len(SCHEME):].split("/", 1)[0])
    return FileSystemError(str(exc), hint=HINTS.get(kind, HINTS["other"]), path=url)

"""API keys: a file of ``sha256hex tenant`` lines; the key's tenant labels the generation.

A caller sends its key as ``Authorization: Bearer KEY`` (OpenAI's way) or ``x-api-key: KEY`` (Anthropic's).

The file holds only hashes (``printf %s "$KEY" | sha256sum``), so reading
it reveals no key. A key is looked up by the hash of what the caller sent.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from tokenmesh.config import ConfigError
from tokenmesh_gateway._errors import HttpError

_LINE = re.compile(r"([0-9a-fA-F]{64})\s+(\S+)")


def load_keys(path: str) -> dict[str, str]:
    """sha256 hex digest (lower case) -> tenant, from the keys file; ConfigError naming the bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api_keys_file {path}: cannot read it ({exc})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        match = _LINE.fullmatch(text)
        if match is None:
            raise ConfigError(
                f"api_keys_file {path}:{number}: expected 'sha256hex tenant' (64 hex digits, a "
                "space, a tenant name without spaces)"
            )
        digest = match.group(1).lower()
        if digest in keys:
            raise ConfigError(f"api_keys_file {path}:{number}: this key hash is listed twice")
        keys[digest] = match.group(2)
    if not keys:
        raise ConfigError(f"api_keys_file {path} lists no key; leave --api-keys-file empty to accept any caller")
    return keys


def hash_key(key: str) -> str:
    """The file's form of a key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_of(keys: dict[str, str], authorization: bytes | None, api_key: bytes | None = None) -> str:
    """The tenant of the caller's key; 401 without a listed key.

    The key is ``x-api-key: KEY`` (Anthropic's header) when the caller sends
    one, else ``Authorization: Bearer KEY``.
    """
    if api_key is not None:
        tenant = keys.get(hash_key(api_key.decode("latin-1").strip()))
    elif authorization is not None:
        scheme, _, key = authorization.decode("latin-1").strip().partition(" ")
        tenant = keys.get(hash_key(key.strip())) if scheme.lower() == "bearer" else None
    else:
        raise HttpError(
            401,
            "this gateway needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="invalid_api_key",
        )
    if tenant is None:
        raise HttpError(
            401,
            "the API key is not valid: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' with a key this "
            "gateway lists",
            code="invalid_api_key",
        )
    return tenant

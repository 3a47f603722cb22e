"""Where a memory lives, from what `--db` / `perpetuity_db` / $PERPETUITY_DB says.

A plain path, or `sqlite:///absolute/path` (`sqlite:///` followed by the path, as in
`sqlite:///home/me/memory.db`), names a SQLite file; `postgresql://user@host:port/dbname` (or
`postgres://`) a PostgreSQL database. Any other URL is refused with one line:
`pathlib.Path("postgresql://u@h/db")` is the relative path `postgresql:/u@h/db`, so without this a
URL the store cannot open silently became a folder named `postgresql:` holding a new SQLite file.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from perpetuity_core.errors import ConfigError

# A URL's scheme as RFC 3986 spells it; a Windows drive ("C:\\...") has no "//" after it.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def shown(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username}:***@{host}").geturl()


def where(location: str | Path) -> Path | str:
    """The SQLite file `location` names, or its PostgreSQL URL (as `postgresql://`)."""
    if isinstance(location, str) and location.lower().startswith(("postgresql://", "postgres://")):
        parts = urlsplit(location)
        if not parts.hostname or not parts.path.strip("/"):
            raise ConfigError(f"cannot open the memory database {shown(location)}: a PostgreSQL"
                              " URL is postgresql://user@host:port/dbname")
        return "postgresql://" + location.split("://", 1)[1]
    return sqlite_path(location)


def sqlite_path(location: str | Path) -> Path:
    """The SQLite file `location` names, or ConfigError when it is a URL the store cannot open."""
    if isinstance(location, Path) or not _URL.match(location):
        return Path(location).expanduser()
    parts = urlsplit(location)
    if parts.scheme.lower() == "sqlite":
        if parts.netloc or not parts.path.strip("/") or parts.query:
            raise ConfigError(f"cannot open the memory database {shown(location)}: a SQLite URL"
                              " is sqlite:/// followed by the file's path")
        return Path(unquote(parts.path)).expanduser()
    raise ConfigError(f"cannot open the memory database {shown(location)}: {parts.scheme}:// is"
                      " not a store this version can open (give a file path, sqlite:///path or"
                      " postgresql://user@host:port/dbname)")

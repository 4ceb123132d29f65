"""Where Hypothesis keeps the examples a run found, so the next run tries them first
(issue 28, item 3). Hypothesis replays every saved example before it generates
new ones (its ``reuse`` phase), so a failure found by one run is the first thing
the next run does, on any machine that shares the database.

``--db`` takes:

- a directory (default ``.kvspec/examples``): this machine's runs;
- ``redis://HOST:PORT[/N]``: a Redis server shared by machines
  (Hypothesis' ``RedisExampleDatabase``; needs the ``redis`` package);
- ``github-artifact:OWNER/REPO[/ARTIFACT]``: the database a GitHub workflow
  uploaded as an artifact (Hypothesis' ``GitHubArtifactDatabase``, read-only,
  default artifact ``hypothesis-example-db``; needs ``GITHUB_TOKEN`` for private
  repositories), read beside the local directory, which keeps what this run finds.
"""
from __future__ import annotations

import datetime
from pathlib import Path

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

LOCAL = Path(".kvspec/examples")
ARTIFACT = "hypothesis-example-db"


class DatabaseError(ValueError):
    """A ``--db`` that cannot be used; the message is one line."""


def is_remote(spec: str | Path) -> bool:
    return str(spec).startswith(("redis://", "rediss://", "github-artifact:"))


def open_redis(url: str) -> ExampleDatabase:
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        raise DatabaseError(f"--db {url}: needs the redis package (pip install redis)") from None
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise DatabaseError(f"--db {url}: the server does not answer ({exc})") from None
    # a long expiry: a failure found once stays until a run no longer fails on it
    return RedisExampleDatabase(client, expire_after=datetime.timedelta(days=30),
                                key_prefix=b"kvspec:")


def open_artifact(spec: str, local: Path) -> ExampleDatabase:
    where = spec.split(":", 1)[1]
    parts = where.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise DatabaseError(f"--db {spec}: expected github-artifact:OWNER/REPO[/ARTIFACT]")
    owner, repo = parts[0], parts[1]
    artifact = parts[2] if len(parts) == 3 else ARTIFACT
    shared = ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo, artifact_name=artifact))
    return MultiplexedDatabase(DirectoryBasedExampleDatabase(str(local)), shared)


def open_database(spec: str | Path | None) -> ExampleDatabase | None:
    """The database ``--db`` names (None: keep nothing)."""
    if spec is None:
        return None
    text = str(spec)
    if text.startswith(("redis://", "rediss://")):
        return open_redis(text)
    if text.startswith("github-artifact:"):
        return open_artifact(text, LOCAL)
    return DirectoryBasedExampleDatabase(text)

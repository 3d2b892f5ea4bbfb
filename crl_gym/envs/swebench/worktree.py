"""The image's work tree as a tar stream, for the copy into each sandbox's tmpfs.

The work tree's tmpfs hides the image's own copy, so the tree is read through a second container
created (never started) without that mount. An image's content never changes under its id, so a
tree up to :data:`CACHE_MAX_BYTES` is read once per image id and kept in memory: later sandboxes
of the image skip the second container's create, read and removal. Concurrent first starts of
one image wait for one read (a lock per image, not one for all); larger trees are streamed anew
each time, as before.
"""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from docker import DockerClient

CACHE_MAX_BYTES = 64 * 1024 * 1024
"""Largest tree kept in memory (per image); the demo repository is a few hundred KiB."""
CACHE_TOTAL_BYTES = 512 * 1024 * 1024
"""All cached trees together; past it, trees are streamed instead of cached."""

_cache: dict[tuple[str, str], tuple[tarfile.TarInfo | None, bytes | None]] = {}
_cached_bytes = 0
_locks: dict[tuple[str, str], threading.Lock] = {}
_guard = threading.Lock()  # held only to look up or insert, never during a read


def first_member(chunks: Iterator[bytes]) -> tuple[tarfile.TarInfo | None, Iterator[bytes]]:
    """The first entry of a tar stream and the whole stream again (nothing is consumed)."""
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= 64 * 1024:
            break
    try:
        info = tarfile.open(fileobj=io.BytesIO(head), mode="r:").next()
    except tarfile.TarError:
        info = None
    return info, itertools.chain([head], chunks)


def _read(
    client: DockerClient, image: str, workdir: str, labels: dict[str, str]
) -> tuple[Any, tarfile.TarInfo | None, Iterator[bytes] | None]:
    """Stream the tree through a created container; ``(container, tree's own entry, stream)``."""
    import docker

    source = client.containers.create(
        image,
        command=["true"],
        labels=labels,
        network_mode="none",
        name=f"crl-sandbox-src-{uuid.uuid4().hex[:12]}",
    )
    try:
        chunks, _ = source.get_archive(workdir.rstrip("/") + "/.")
    except docker.errors.NotFound:
        return source, None, None
    info, tree = first_member(iter(chunks))
    return source, info, tree


def image_tree(
    client: DockerClient, image: str, workdir: str, labels: dict[str, str]
) -> tuple[Any, tarfile.TarInfo | None, Iterator[bytes] | None]:
    """``(container to remove or None, the tree's own entry, the tar stream or None)``
    for ``image``.

    The entry gives the tree's owner and mode; no stream when the image has no such directory.
    """
    global _cached_bytes
    key = (client.images.get(image).id, workdir)
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if key in _cache:
            info, data = _cache[key]
            return None, info, (iter([data]) if data is not None else None)
        source, info, tree = _read(client, image, workdir, labels)
        if tree is None:
            with _guard:
                _cache[key] = (info, None)
            return source, info, None
        parts: list[bytes] = []
        size = 0
        for chunk in tree:
            parts.append(chunk)
            size += len(chunk)
            if size > CACHE_MAX_BYTES:  # too big to keep: stream the rest
                return source, info, itertools.chain(parts, tree)
        data = b"".join(parts)
        with _guard:
            if _cached_bytes + size <= CACHE_TOTAL_BYTES:
                _cache[key] = (info, data)
                _cached_bytes += size
        return source, info, iter([data])

"""Which image an instance's containers start from, and how it is built when none exists.

1. swebench's own ``sweb.eval.*`` image for the instance, when it is present locally (the
   instance's ``image`` field, ``sweb.eval.x86_64.<id>:latest`` or its ``swebench/`` namespaced
   name). Nothing is pulled: this machine has no registry.
2. Otherwise an image built from the project's base image (``BASE_IMAGE``, made by
   ``.ci/docker.sh`` from debootstrap, no registry) plus the repository at ``base_commit``,
   copied in from a local git checkout (``repo_path``) or a tarball of one (``repo_tarball``).
   The copy is a fresh clone with every later commit pruned, so the fix is not in its history.
   Built images are tagged ``crl/swe-instance:<hash>``, labelled and reused.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from docker import DockerClient

    from crl_gym.envs.swebench.tasks import SWEInstance

# Keep in step with .ci/docker.sh (tests/test_swebench_sandbox.py checks they agree).
BASE_IMAGE = os.environ.get("CRL_SWE_BASE_IMAGE", "crl/swe-base:bookworm-v1")
INSTANCE_REPO = "crl/swe-instance"
IMAGE_LABEL = "crl.sandbox.image"
SWEB_ENV_SETUP = (
    "[ -f /opt/miniconda3/bin/activate ] && . /opt/miniconda3/bin/activate testbed "
    ">/dev/null 2>&1; "
)
_BUILD_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


class ImageError(RuntimeError):
    """An instance's image cannot be found or built; the message says what is missing."""


@dataclass(frozen=True)
class ImageChoice:
    """The image for an instance and how its containers must be set up."""

    name: str
    kind: str
    """``"swebench"`` (a local sweb.eval image) or ``"built"`` (base image + repository)."""
    env_setup: str = ""
    chown_workdir: bool = False


def image_exists(client: DockerClient, name: str) -> bool:
    import docker

    try:
        client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_base_image(client: DockerClient, name: str = BASE_IMAGE) -> str:
    """The base image's name, or :class:`ImageError` saying how to build it."""
    if not image_exists(client, name):
        raise ImageError(
            f"base image {name!r} is missing. Build it (no registry needed) with `bash "
            ".ci/docker.sh`: debootstrap of Debian bookworm with python3, git and pytest, then "
            "`docker import`."
        )
    return name


def sweb_image_candidates(instance: SWEInstance) -> list[str]:
    """Names swebench gives the instance's evaluation image, most specific first."""
    iid = str(instance["instance_id"])
    key = f"sweb.eval.x86_64.{iid}:latest".lower()
    names = [str(instance["image"])] if instance.get("image") else []
    return names + [key, f"swebench/{key}".replace("__", "_1776_")]


def _git(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()}")
    return proc.stdout


def _checkout_at(source: Path, base_commit: str, dest: Path) -> None:
    """A clone of ``source`` at ``base_commit`` whose history ends there."""
    _git(
        ["clone", "--quiet", "--no-checkout", "--no-hardlinks", str(source), str(dest)],
        source.parent,
    )
    _git(["-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", base_commit], dest)
    for ref in _git(["for-each-ref", "--format=%(refname)"], dest).split():
        _git(["update-ref", "-d", ref], dest)
    _git(["remote", "remove", "origin"], dest)
    _git(["reflog", "expire", "--expire=now", "--all"], dest)
    _git(["gc", "--quiet", "--prune=now"], dest)


def repo_archive(source: str | Path, base_commit: str, uid: int = 1000, gid: int = 1000) -> bytes:
    """A tar of ``testbed/`` holding the repository at ``base_commit``, owned by ``uid:gid``.

    ``source`` is a git checkout or a tarball (``.tar``, ``.tar.gz``, ``.tgz``) of one.
    """
    src = Path(source).expanduser().resolve()
    if not src.exists():
        raise ImageError(f"repository source {src} does not exist")
    with tempfile.TemporaryDirectory(prefix="crl-repo-") as tmp:
        work = Path(tmp)
        if src.is_file():
            try:
                with tarfile.open(src) as tar:
                    tar.extractall(work / "src", filter="data")
            except tarfile.TarError as exc:
                raise ImageError(f"repository tarball {src} cannot be read: {exc}") from exc
            roots = [p for p in (work / "src").iterdir()]
            src = roots[0] if len(roots) == 1 and (roots[0] / ".git").exists() else work / "src"
        if not (src / ".git").exists():
            raise ImageError(
                f"repository source {source} is not a git checkout (no .git); base_commit cannot "
                "be checked out"
            )
        _checkout_at(src, base_commit, work / "testbed")
        buf = io.BytesIO()

        def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid, info.gid, info.uname, info.gname = uid, gid, "agent", "agent"
            return info

        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(work / "testbed", arcname="testbed", filter=owned)
        return buf.getvalue()


def _lock_for(tag: str) -> threading.Lock:
    with _LOCKS_LOCK:
        return _BUILD_LOCKS.setdefault(tag, threading.Lock())


def build_instance_image(
    client: DockerClient, instance: SWEInstance, source: str | Path, base: str = BASE_IMAGE
) -> str:
    """Build (or reuse) ``crl/swe-instance:<hash>``: the base image plus the repository."""
    from crl_gym.envs.swebench.sandbox import DockerSandbox, SandboxConfig

    ensure_base_image(client, base)
    src = Path(source).expanduser().resolve()
    stamp = src.stat().st_mtime_ns if src.is_file() else _git(["rev-parse", "HEAD"], src).strip()
    digest = hashlib.sha256(
        f"{base}|{instance['instance_id']}|{instance['base_commit']}|{src}|{stamp}".encode()
    ).hexdigest()
    tag = f"{INSTANCE_REPO}:{digest[:16]}"
    if image_exists(
        client, tag
    ):  # built already: no lock, so a batch of resets does not queue here
        return tag
    with _lock_for(tag):
        if image_exists(client, tag):
            return tag
        archive = repo_archive(src, str(instance["base_commit"]))
        # disk_quota off: the repository goes into the writable layer that `commit` keeps (no agent
        # runs here)
        sandbox = DockerSandbox(base, SandboxConfig(disk_quota=False), client).start()
        try:
            sandbox.put_tree("/", archive)
            sandbox.container.commit(
                repository=INSTANCE_REPO,
                tag=digest[:16],
                conf={
                    "Labels": {IMAGE_LABEL: "1", "crl.instance_id": str(instance["instance_id"])},
                    "WorkingDir": "/testbed",
                    "Cmd": ["/bin/bash"],
                },
            )
        finally:
            sandbox.close()
    return tag


def instance_image(client: DockerClient, instance: SWEInstance) -> ImageChoice:
    """The image an instance's episode and grading containers start from (see module doc)."""
    for name in sweb_image_candidates(instance):
        if image_exists(client, name):
            return ImageChoice(name, "swebench", env_setup=SWEB_ENV_SETUP, chown_workdir=True)
    source = instance.get("repo_path") or instance.get("repo_tarball")
    if not source:
        raise ImageError(
            f"instance {instance['instance_id']!r}: no local swebench image "
            f"({', '.join(sweb_image_candidates(instance))}) and no repository source; add "
            "`repo_path` (a git checkout) or `repo_tarball` to the instance"
        )
    return ImageChoice(build_instance_image(client, instance, source), "built")


def remove_instance_images(client: DockerClient) -> int:
    """Remove every image built by :func:`build_instance_image`; returns how many."""
    removed = 0
    for image in client.images.list(filters={"label": f"{IMAGE_LABEL}=1"}):
        try:
            client.images.remove(image.id, force=True)
            removed += 1
        except Exception:  # in use by a running episode; keep it
            continue
    return removed

"""The ``crl-experience`` command: ``crl-experience serve`` runs the experience service over HTTP.

What a deployment decides lives here, apart from the app it serves (:mod:`crl_gym.server`):
which bank and embedder to open (:func:`build_manager`), whether the extractor's loop runs in
the service (``--extractor``, from the optional ``crl_train``), where the token comes from
(:func:`resolve_token`), which interfaces may be bound without one (:func:`is_loopback`), and
how uvicorn runs and stops (SIGINT / SIGTERM close the service, then exit 0).

    crl-experience serve --bank DIR --port 8765 [--host H] [--embedder hashing:384]
        [--extractor tiny|CONFIG.yaml [--merge-seeded]] [--token-file FILE]
        [--max-body-bytes N] [--persist-interval S]
    crl-experience ui --bank DIR [--port 8766] [--host H] [--token-file FILE]
        (the explorer alone, read-only)
    crl-experience snapshot BANK [--name N] | list-snapshots BANK | restore BANK N   [--url URL]
    crl-experience quarantine BANK --written-by extractor --steps A:B [--undo]    [--url URL]

``snapshot``, ``list-snapshots``, ``restore`` and ``quarantine`` work on the bank's files, or with
``--url`` through the server that holds it open (docs/service.md).

The service serves the bank explorer at ``/ui`` (:mod:`crl_gym.explorer`, docs/explorer.md).

``python -m crl_gym.cli`` runs the same command.
"""

from __future__ import annotations

import gc
import ipaddress
import os
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, cast

import click
import uvicorn
from fastapi import Depends

from crl_gym.clients import TOKEN_ENV
from crl_gym.experience.bank import BankLockedError
from crl_gym.experience.origin import WRITERS, parse_steps
from crl_gym.experience.service import RetrievalService
from crl_gym.experience.snapshots import list_snapshots, restore_snapshot, take_snapshot
from crl_gym.experience.store import BankCorruptError
from crl_gym.server import BACKLOG, KEEP_ALIVE_S, MAX_BODY_BYTES, check_token, create_app

if TYPE_CHECKING:
    from crl_gym.clients import RemoteClient
    from crl_gym.experience.manager import ExperienceManager


def build_manager(
    bank_dir: str | Path, embedder: str | None, persist_interval_s: float | None = None
) -> ExperienceManager:
    """Open (or create) the bank in ``bank_dir`` and an ``ExperienceManager`` over it."""
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.config import ManagerConfig
    from crl_gym.experience.embedders import embedder_name, load_embedder
    from crl_gym.experience.manager import ExperienceManager

    emb = load_embedder(embedder)
    bank = ExperienceBank(Path(bank_dir), dim=emb.dim, embedder_name=embedder_name(emb))
    try:
        config = (
            ManagerConfig()
            if persist_interval_s is None
            else ManagerConfig(persist_interval_s=persist_interval_s)
        )
        return ExperienceManager(bank, emb, config)
    except BaseException:
        bank.close()
        raise


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only exposes the server to this machine."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def resolve_token(token_file: str | None) -> str | None:
    """The token from ``token_file`` (stripped; empty is an error), else from
    ``CRL_EXPERIENCE_TOKEN``."""
    if token_file is not None:
        token = Path(token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise click.BadParameter(f"{token_file} is empty", param_hint="--token-file")
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
    try:
        return check_token(token)
    except ValueError as exc:
        raise click.BadParameter(
            str(exc), param_hint="--token-file" if token_file else TOKEN_ENV
        ) from exc


class _StopOnSignal(uvicorn.Server):
    """``uvicorn.Server`` whose SIGINT / SIGTERM mean "shut down and return".

    uvicorn re-raises the signal once it has shut down, which would kill the command before it
    closes the service (queue persisted, bank flushed) and make it exit non-zero.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


@click.group()
def cli() -> None:
    """Experience bank tools."""


@cli.command()
@click.option(
    "--bank",
    "bank_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Bank directory (created if missing).",
)
@click.option(
    "--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="TCP port."
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind. Anything but loopback (e.g. 0.0.0.0) needs a token.",
)
@click.option(
    "--embedder",
    default=None,
    help="'default' (bundled MiniLM), 'hashing:DIM', or a sentence-transformers id/path.",
)
@click.option(
    "--extractor",
    default=None,
    help="Run the extractor's learning loop in the service: 'tiny' or a crl-train YAML config "
    "(needs crl_train).",
)
@click.option(
    "--merge-seeded",
    is_flag=True,
    default=False,
    help="With --extractor: let the Merge merge, rewrite or discard entries written without an "
    "extractor sample (your own AddOps). By default they are kept as written.",
)
@click.option(
    "--token-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help=f"File holding the bearer token clients must send (default: ${TOKEN_ENV}).",
)
@click.option(
    "--max-body-bytes",
    default=MAX_BODY_BYTES,
    show_default=True,
    type=click.IntRange(1),
    help="Largest request body accepted; a larger one is answered 413 before it is parsed.",
)
@click.option(
    "--persist-interval",
    "persist_interval_s",
    default=None,
    type=click.FloatRange(0),
    help="Seconds between checkpoints of the queued requests to the bank dir (a SIGKILL loses at "
    "most this window; default 0.5; 0: only on shutdown).",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def serve(
    bank_dir: str,
    port: int,
    host: str,
    embedder: str | None,
    extractor: str | None,
    merge_seeded: bool,
    token_file: str | None,
    max_body_bytes: int,
    persist_interval_s: float | None,
    log_level: str,
) -> None:
    """Serve the experience bank in BANK over HTTP for RemoteClient."""
    token = resolve_token(token_file)
    if token is None and not is_loopback(host):
        raise click.UsageError(
            f"refusing to bind {host} without a token: anyone who can reach it could read and "
            f"rewrite the bank. Pass --token-file FILE or set {TOKEN_ENV}, or bind 127.0.0.1."
        )
    service = _build_service(
        bank_dir, embedder, extractor, persist_interval_s, merge_seeded=merge_seeded
    )
    # The embedder (torch, transformers) leaves ~10^6 long-lived objects; a full collection
    # walks them all (~250 ms here) in the middle of whatever requests are in flight. Frozen,
    # they are skipped: collections only see what the server allocates from now on.
    gc.collect()
    gc.freeze()
    auth = "token required" if token else "no token"
    click.echo(
        f"crl-experience: serving {bank_dir} on http://{host}:{port} ({auth}"
        f"{', extractor ' + extractor if extractor else ''})",
        err=True,
    )
    app = create_app(service, token, max_body_bytes)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
        backlog=BACKLOG,
    )
    try:
        _StopOnSignal(config).run()
    finally:
        app.state.coalescer.close()
        app.state.explorer.close()
        service.close()
    click.echo("crl-experience: stopped; bank closed", err=True)


@cli.command()
@click.option(
    "--bank",
    "bank_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="A bank directory, or a run directory with its bank in bank/ (e.g. runs/tiny).",
)
@click.option(
    "--port", default=8766, show_default=True, type=click.IntRange(0, 65535), help="TCP port."
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind. Anything but loopback needs a token.",
)
@click.option(
    "--embedder",
    default=None,
    help="The embedder for the search page (default: the one the bank records).",
)
@click.option(
    "--token-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help=f"File holding the bearer token the page must send (default: ${TOKEN_ENV}).",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def ui(
    bank_dir: str,
    port: int,
    host: str,
    embedder: str | None,
    token_file: str | None,
    log_level: str,
) -> None:
    """Browse the bank in BANK read-only (no extractor, no writing route) at http://HOST:PORT/ui."""
    from crl_gym.experience.embedders import load_embedder
    from crl_gym.explorer import BankSource, explorer_app
    from crl_gym.server import _bearer

    token = resolve_token(token_file)
    if token is None and not is_loopback(host):
        raise click.UsageError(
            f"refusing to bind {host} without a token: pass --token-file FILE or set {TOKEN_ENV}, "
            f"or bind 127.0.0.1."
        )
    try:
        source = BankSource.open(bank_dir, load_embedder(embedder) if embedder else None)
    except (ValueError, FileNotFoundError, BankCorruptError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"crl-experience: exploring {source.bank_dir} read-only on http://{host}:{port}/ui "
        f"({'token required' if token else 'no token'})",
        err=True,
    )
    app = explorer_app(source, [Depends(_bearer(token))] if token else None)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S
    )
    try:
        _StopOnSignal(config).run()
    finally:
        source.close()
    click.echo("crl-experience: stopped", err=True)


# -- the bank's administration: snapshots, restore, quarantine (docs/service.md) ------------------
_BANK_ARG = click.argument("bank", type=click.Path(file_okay=False))
_URL_OPT = click.option(
    "--url",
    default=None,
    help="Do it on the server at this URL (http://host:port) instead, for a bank a server holds "
    f"open (the token from ${TOKEN_ENV}).",
)


def _offline_manager(bank: str) -> ExperienceManager:
    """The bank in ``bank`` (or in its ``bank/``, a run directory) with a manager over it, for an
    operation on its files. Its embedder is never called here: a hashing one of the bank's dim
    stands in, so no model is loaded."""
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.config import ManagerConfig
    from crl_gym.experience.embedders import HashingEmbedder
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.experience.store import open_readonly
    from crl_gym.explorer.source import find_bank

    try:
        bank_dir = find_bank(bank)
        conn = open_readonly(bank_dir / "bank.sqlite")
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
        finally:
            conn.close()
        if row is None:
            raise BankCorruptError(f"{bank_dir}: the bank records no dim")
        b = ExperienceBank(bank_dir, dim=int(row[0]), create=False)
    except (FileNotFoundError, ValueError, BankCorruptError) as exc:
        raise click.ClickException(str(exc)) from exc
    except BankLockedError as exc:
        raise click.ClickException(f"{exc}; do it through that server with --url") from exc
    return ExperienceManager(b, HashingEmbedder(b.dim), ManagerConfig(persist_interval_s=0))


def _close(manager: ExperienceManager) -> None:
    manager.close()
    manager.bank.close()


def _remote(url: str) -> RemoteClient:
    from crl_gym.clients import RemoteClient

    return RemoteClient(url, timeout=600)


@cli.command()
@_BANK_ARG
@click.option(
    "--name",
    default=None,
    help="The snapshot's name (letters, digits, '.', '_', '-'); default: the UTC time.",
)
@_URL_OPT
def snapshot(bank: str, name: str | None, url: str | None) -> None:
    """Snapshot the bank in BANK (its entries, counters, event log and queued requests) as
    BANK/snapshots/NAME."""
    if url:
        info = _remote(url).snapshot_bank(name)
    else:
        manager = _offline_manager(bank)
        try:
            info = take_snapshot(manager, name).to_dict()
        except (ValueError, FileExistsError) as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            _close(manager)
    click.echo(
        f"snapshot {info['name']}: {info['entries']} entries, {info['pending']} queued requests, "
        f"in {info['path']}"
    )


@cli.command("list-snapshots")
@_BANK_ARG
@_URL_OPT
def list_snapshots_command(bank: str, url: str | None) -> None:
    """The snapshots of the bank in BANK, newest first."""
    from crl_gym.explorer.source import find_bank

    if url:
        found = _remote(url).bank_snapshots()
    else:
        try:
            found = [s.to_dict() for s in list_snapshots(find_bank(bank))]
        except FileNotFoundError as exc:
            raise click.ClickException(str(exc)) from exc
    if not found:
        click.echo("no snapshots")
    for s in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(s["created_at"])))
        click.echo(f"{s['name']}\t{when}\t{s['entries']} entries\t{s['pending']} queued")


@cli.command()
@_BANK_ARG
@click.argument("name")
@_URL_OPT
def restore(bank: str, name: str, url: str | None) -> None:
    """Make the bank in BANK the snapshot NAME again (the state before is kept as a
    snapshot too)."""
    if url:
        out = _remote(url).restore_bank(name)
        before, size = out["before"]["name"], out["bank_size"]
    else:
        manager = _offline_manager(bank)
        try:
            before = restore_snapshot(manager, name).name
            size = len(manager.bank)
        except (ValueError, FileNotFoundError, BankCorruptError) as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            _close(manager)
    click.echo(f"restored {name}: {size} entries; the state before is the snapshot {before}")


@cli.command()
@_BANK_ARG
@click.option(
    "--written-by",
    "written_by",
    required=True,
    type=click.Choice(list(WRITERS)),
    help="Whose writes: the extractor, a user's ops, a Merge, an import.",
)
@click.option(
    "--steps",
    default=":",
    show_default=True,
    help="A:B, both included (either end may be left out): the extractor's model steps, else the "
    "rollout steps.",
)
@click.option("--undo", is_flag=True, default=False, help="Bring the entries back instead.")
@_URL_OPT
def quarantine(bank: str, written_by: str, steps: str, undo: bool, url: str | None) -> None:
    """Hide (not delete) from retrieval what WRITTEN-BY wrote in STEPS in the bank in
    BANK; --undo brings it back."""
    try:
        window = parse_steps(steps)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--steps") from exc
    if url:
        ids = list(_remote(url).quarantine(written_by, steps, undo=undo)["entries"])
    else:
        manager = _offline_manager(bank)
        try:
            ids = manager.bank.quarantine(written_by, window, undo=undo)
        finally:
            _close(manager)
    shown = ", ".join(map(str, ids[:20])) + (" …" if len(ids) > 20 else "")
    click.echo(
        f"{'restored' if undo else 'quarantined'} {len(ids)} entries written by {written_by} "
        f"at steps {steps}{': ' + shown if ids else ''}"
    )


SERVE_EXTRACTOR_GROUP = "crl_gym.serve_extractor"
"""Entry-point group of what builds the service behind ``serve --extractor``: a callable
``(bank_dir: Path, extractor: str, embedder: str | None, *, merge_seeded: bool) ->
RetrievalService``. The training package registers its builder here (setup.cfg), so crl_gym never
imports it by name."""


def _served_service_builder() -> Callable[..., RetrievalService]:
    """The registered builder (the first by name when several are), or a ``ClickException``
    saying what to install."""
    need = "--extractor needs the crl_train package (pip install 'complementary-rl[train]')"
    found = sorted(entry_points(group=SERVE_EXTRACTOR_GROUP), key=lambda ep: ep.name)
    if not found:
        raise click.ClickException(
            f"{need}: no package registers the entry-point group {SERVE_EXTRACTOR_GROUP!r}"
        )
    try:
        builder = found[0].load()
    except (ImportError, AttributeError) as exc:
        raise click.ClickException(f"{need}: {exc}") from exc
    if not callable(builder):
        raise click.ClickException(f"{need}: entry point {found[0].value!r} is not callable")
    return cast("Callable[..., RetrievalService]", builder)


def _build_service(
    bank_dir: str,
    embedder: str | None,
    extractor: str | None,
    persist_interval_s: float | None = None,
    *,
    merge_seeded: bool = False,
) -> RetrievalService:
    if extractor is None:
        try:
            return RetrievalService(build_manager(bank_dir, embedder, persist_interval_s))
        # another embedder or dim, a damaged or foreign database, a bank another process holds
        except (ValueError, BankCorruptError, BankLockedError) as exc:
            raise click.ClickException(str(exc)) from exc
    build_served_service = _served_service_builder()
    try:
        service: RetrievalService = build_served_service(
            Path(bank_dir), extractor, embedder, merge_seeded=merge_seeded
        )
        return service
    except (ValueError, FileNotFoundError, BankCorruptError, BankLockedError) as exc:
        raise click.ClickException(f"--extractor {extractor}: {exc}") from exc


if __name__ == "__main__":  # pragma: no cover
    cli()

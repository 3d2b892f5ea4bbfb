"""``crl-experience snapshot / list-snapshots / restore / quarantine``: on a bank's files, on a run
directory's ``bank/``, and with ``--url`` through the server that holds the bank open."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from crl_gym.cli import cli
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import RetrievalService
from crl_gym.protocol import AddOp, ExtractorSample
from crl_gym.server import BackgroundServer

EMB = HashingEmbedder(32)


def make_bank(directory: Path) -> RetrievalService:
    """A service over a bank with one entry a user wrote (step 0) and two the extractor wrote at model steps 5 and 9."""
    service = RetrievalService(ExperienceManager(ExperienceBank(directory, dim=EMB.dim), EMB))
    service.apply_ops([AddOp("Sokoban: push boxes along walls.")], step=0)
    for version in (5, 9):
        service.manager.apply_ops([AddOp(f"Sokoban: advice of model step {version}.")],
                                  sample=ExtractorSample("p", "r", extractor_version=version), step=1)
    return service


def run(*args: str) -> str:
    out = CliRunner().invoke(cli, list(args))
    assert out.exit_code == 0, out.output
    return out.output


def test_the_operations_on_a_run_directory(tmp_path: Path) -> None:
    make_bank(tmp_path / "run" / "bank").close()
    run_dir = str(tmp_path / "run")  # a run directory: its bank is in bank/
    assert "snapshot start: 3 entries" in run("snapshot", run_dir, "--name", "start")
    assert "quarantined 1 entries written by extractor at steps 6:9: 3" in run(
        "quarantine", run_dir, "--written-by", "extractor", "--steps", "6:9")
    with ExperienceBank(tmp_path / "run" / "bank", dim=EMB.dim) as bank:
        assert bank.ids() == [1, 2]
    assert "restored start: 3 entries" in run("restore", run_dir, "start")
    listed = run("list-snapshots", run_dir).splitlines()
    assert listed[0].startswith("before-restore-") and listed[1].startswith("start\t")
    refused = CliRunner().invoke(cli, ["snapshot", run_dir, "--name", "start"])
    assert refused.exit_code != 0 and "exists already" in refused.output
    unknown = CliRunner().invoke(cli, ["restore", run_dir, "nope"])
    assert unknown.exit_code != 0 and "no snapshot 'nope'" in unknown.output and "start" in unknown.output


def test_a_bank_a_server_holds_is_reached_with_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRL_EXPERIENCE_TOKEN", "s3cret")
    service = make_bank(tmp_path / "bank")
    try:
        with BackgroundServer(service, token="s3cret") as server:
            held = CliRunner().invoke(cli, ["snapshot", str(tmp_path / "bank")])
            assert held.exit_code != 0 and "--url" in held.output  # the server holds the bank's lock
            assert "snapshot first: 3 entries" in run("snapshot", str(tmp_path / "bank"), "--name", "first", "--url", server.url)
            assert "quarantined 2 entries written by extractor" in run(
                "quarantine", "-", "--written-by", "extractor", "--url", server.url)
            assert len(service.manager.bank) == 1
            assert run("list-snapshots", "-", "--url", server.url).startswith("first\t")
            assert "restored first: 3 entries" in run("restore", "-", "first", "--url", server.url)
            assert len(service.manager.bank) == 3
    finally:
        service.close()

"""Suite variants: named reference lines (a method with its own overrides) with cells and report rows of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from crl_train.config import ConfigError
from crl_train.experiment.report import results_table, write_report
from crl_train.experiment.suite import (
    Cell,
    Variant,
    cell_config,
    cells,
    load_suite,
    record_dir,
    suite_from_dict,
)

REPO = Path(__file__).resolve().parents[1]
ORACLE = {"oracle": {"method": "static_online", "set": ["extractor.model=oracle"]}}


def _suite(**extra: Any) -> Any:
    return suite_from_dict({"name": "v", "methods": ["grpo", "static_online"], "seeds": [0, 1], "variants": ORACLE,
                            "set": ["train.steps=3"], **extra})


def test_a_variant_is_a_row_with_cells_on_every_seed() -> None:
    suite = _suite()
    assert suite.variants == {"oracle": Variant("static_online", ("extractor.model=oracle",))}
    assert suite.rows == ("grpo", "static_online", "oracle")
    assert [c.name for c in cells(suite) if c.method == "oracle"] == [
        "oracle/MiniHack-Room-5x5-v0/seed0", "oracle/MiniHack-Room-5x5-v0/seed1"]
    assert len(cells(suite)) == 6


def test_a_variant_cell_runs_its_method_with_its_overrides_after_the_suites() -> None:
    suite = _suite(method_set={"static_online": ["extractor.lr=0.5"]})
    cfg = cell_config(suite, Cell("oracle", 1, ("crl/Recall-v0",)))
    assert (cfg.method, cfg.extractor.model, cfg.seed, cfg.env.ids, cfg.train.steps) == (
        "static_online", "oracle", 1, ("crl/Recall-v0",), 3)
    assert cfg.extractor.lr != 0.5  # the method's own overrides are not the variant's
    plain = cell_config(suite, Cell("static_online", 1, ("crl/Recall-v0",)))
    assert (plain.extractor.model, plain.extractor.lr) == ("tiny", 0.5)
    later = suite_from_dict({"name": "v", "methods": ["grpo"], "seeds": [0], "set": ["train.steps=3"],
                             "variants": {"long": {"method": "grpo", "set": ["train.steps=9"]}}})
    assert cell_config(later, Cell("long", 0, ("crl/Recall-v0",))).train.steps == 9


@pytest.mark.parametrize("variants,match", [
    ({"grpo": {"method": "static_online"}}, "not a method's"),
    ({"a/b": {"method": "static_online"}}, "directory name"),
    ({"oracle": {"method": "ppo"}}, "needs method"),
    ({"oracle": {"set": ["x=1"]}}, "method"),
    ({"oracle": {"method": "grpo", "sett": []}}, "unknown key 'variants.oracle.sett'"),
    ({"oracle": "static_online"}, "needs method"),
])
def test_bad_variants_are_refused_naming_the_field(variants: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        suite_from_dict({"name": "v", "methods": ["grpo"], "seeds": [0], "variants": variants})


def _record(method: str, seed: int, with_exp: float | None, without: float) -> dict[str, Any]:
    ev: dict[str, Any] = {"without_experience": {"success": without, "actions_per_episode": 1.0}}
    if with_exp is not None:
        ev["with_experience"] = {"success": with_exp, "actions_per_episode": 1.0}
    return {"method": method, "seed": seed, "envs": ["crl/Recall-v0"], "steps": 3, "eval": ev}


def test_the_report_shows_a_variant_as_its_own_row_paired_with_grpo(tmp_path: Path) -> None:
    suite = _suite()
    records = [_record("grpo", 0, None, 0.25), _record("grpo", 1, None, 0.25),
               _record("static_online", 0, 0.3, 0.25), _record("static_online", 1, 0.2, 0.25),
               _record("oracle", 0, 0.9, 0.5), _record("oracle", 1, 0.7, 0.3)]
    rows = results_table(records, suite.rows)
    oracle = next(r for r in rows if "| oracle |" in r)
    # with experience: mean 0.8; without: 0.4; paired Δ to grpo over seeds 0 and 1: (0.25 + 0.05) / 2 = 0.15
    assert oracle.startswith("| crl/Recall-v0 | oracle | 2 | 0.800 ") and "| 0.400 " in oracle and "| 0.150 [" in oracle
    assert [r.split("|")[2].strip() for r in rows[2:]] == ["grpo", "static_online", "oracle"]
    for r in records:
        record_dir(tmp_path, r).mkdir(parents=True)
    report = write_report(suite, tmp_path, records).read_text(encoding="utf-8")
    assert "reference line oracle (static_online with extractor.model=oracle)" in report
    assert "### oracle (seed 0)" in report  # its bank has its own section
    assert "variants:" in report and "extractor.model=oracle" in report  # the suite as run


def test_the_recall_suite_loads_with_its_oracle_line() -> None:
    suite = load_suite(REPO / "experiments" / "recall.yaml")
    assert set(suite.methods) == {"grpo", "static_online", "complementary"} and len(suite.seeds) >= 5
    assert suite.envs == (("crl/Recall-v0",),)
    assert suite.variants["oracle"].method in suite.methods
    cfg = cell_config(suite, Cell("oracle", suite.seeds[0], suite.envs[0]))
    assert cfg.extractor.model == "oracle" and cfg.env.ids == ("crl/Recall-v0",)
    for m in suite.methods:  # no method cell uses the oracle: it is the reference line only
        assert cell_config(suite, Cell(m, suite.seeds[0], suite.envs[0])).extractor.model == "tiny"

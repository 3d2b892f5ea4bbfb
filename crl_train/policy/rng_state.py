"""The process's random number generators as JSON, for checkpoints that resume exactly.

A resumed run must draw what the uninterrupted one would have drawn next: the torch CPU generator
(the HF policies' sampling when ``SamplingConfig.seed`` is None, dropout, init), Python's
``random`` and NumPy's legacy global generator. :func:`capture` writes them as JSON-ready values
(the torch state as base64), :func:`restore` puts them back and refuses a malformed state,
naming the key.

>>> import random
>>> saved = capture()
>>> a = (random.random(), float(torch.rand(1)))
>>> restore(saved)
>>> (random.random(), float(torch.rand(1))) == a
True
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from crl_gym.json_types import JSONDict


def capture() -> JSONDict:
    """torch's CPU generator, ``random`` and NumPy's global generator, JSON-ready."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": [version, list(internal), py_gauss],
        "numpy": [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)],
    }


def restore(state: dict[str, Any], what: str = "rng") -> None:
    """Inverse of :func:`capture`; ``ValueError`` naming the key when a part is malformed (then
    nothing is changed)."""
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(state).__name__}")
    try:
        raw = base64.b64decode(str(state["torch"]), validate=True)
        torch_state = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
        version, internal, py_gauss = state["python"]
        py_state = (int(version), tuple(int(x) for x in internal), py_gauss)
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np_state = (
            str(kind),
            np.asarray(keys, dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{what}: not a generator state ({type(exc).__name__}: {exc})") from None
    try:
        current = torch.get_rng_state()
        torch.set_rng_state(torch_state)
    except RuntimeError as exc:
        raise ValueError(f"{what}.torch: not a torch generator state ({exc})") from None
    try:
        random.setstate(py_state)
        np.random.set_state(np_state)
    except (TypeError, ValueError) as exc:
        torch.set_rng_state(current)
        raise ValueError(f"{what}: not a generator state ({type(exc).__name__}: {exc})") from None


__all__ = ["capture", "restore"]

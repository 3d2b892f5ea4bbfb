"""The experience extractor π_φ: the model and its prompts (``model``), and the same interface in a
child process (``worker``), or the weightless ``oracle`` reference. Only
:class:`~crl_train.service.ExperienceService` drives it."""

from crl_train.extractor.base import ExtractorBackend
from crl_train.extractor.model import (
    BufferItem,
    Extractor,
    cispo_update,
    grammar_key,
    reasoning_end_token,
    sample_key,
)
from crl_train.extractor.oracle import OracleExtractor
from crl_train.extractor.worker import (
    ExtractorError,
    ExtractorSpec,
    ExtractorUnavailable,
    ExtractorWorker,
    build_extractor,
)

AnyExtractor = Extractor | ExtractorWorker | OracleExtractor
"""The built-in :class:`ExtractorBackend` implementations: π_φ in process, π_φ in its worker
process, or the oracle."""

__all__ = [
    "AnyExtractor",
    "BufferItem",
    "Extractor",
    "ExtractorBackend",
    "ExtractorError",
    "ExtractorSpec",
    "ExtractorUnavailable",
    "ExtractorWorker",
    "OracleExtractor",
    "build_extractor",
    "cispo_update",
    "grammar_key",
    "reasoning_end_token",
    "sample_key",
]

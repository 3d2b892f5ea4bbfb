"""The experience extractor π_φ: the model and its prompts (``model``), and the same interface in a
child process (``worker``). Only :class:`~crl_train.service.ExperienceService` drives it."""

from crl_train.extractor.model import (
    BufferItem,
    Extractor,
    cispo_update,
    grammar_key,
    reasoning_end_token,
    sample_key,
)
from crl_train.extractor.worker import (
    ExtractorError,
    ExtractorSpec,
    ExtractorUnavailable,
    ExtractorWorker,
    build_extractor,
)

__all__ = ["BufferItem", "Extractor", "ExtractorError", "ExtractorSpec", "ExtractorUnavailable", "ExtractorWorker",
           "build_extractor", "cispo_update", "grammar_key", "reasoning_end_token", "sample_key"]

"""The experience layer: entries, the bank (usearch + SQLite), embedders and the manager."""

from crl_gym.experience.bank import BankCorruptError, ExperienceBank, PendingAdd, PendingUpdate
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import (
    Embedder,
    HashingEmbedder,
    SentenceTransformerEmbedder,
    load_embedder,
)
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.manager import ApplyResult, ExperienceManager
from crl_gym.experience.rwlock import RWLock

__all__ = [
    "ApplyResult",
    "BankCorruptError",
    "Embedder",
    "ExperienceBank",
    "ExperienceEntry",
    "ExperienceManager",
    "HashingEmbedder",
    "ManagerConfig",
    "PendingAdd",
    "PendingUpdate",
    "RWLock",
    "SentenceTransformerEmbedder",
    "load_embedder",
]

"""The experience service: bank, retrieval, queue, extractor, credit, B_φ, CISPO and Merge,
one owner.

Faces: in process through ``crl_gym.clients.LocalClient``, over HTTP through ``crl-experience serve
--extractor`` (``crl_train.serve``) and ``crl_gym.clients.RemoteClient``.
"""

from crl_train.service.build import build_service, service_options, start_service
from crl_train.service.service import EdgeReflection, EdgeUtility, ExperienceService, ServiceOptions

__all__ = [
    "EdgeReflection",
    "EdgeUtility",
    "ExperienceService",
    "ServiceOptions",
    "build_service",
    "start_service",
    "service_options",
]

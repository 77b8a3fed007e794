"""Attention backends: how a batch's queries read the latent caches (see base.py)."""

from latentkv.attention.base import BACKENDS, AttentionBackend, backend_for, register_backend
from latentkv.attention.native import CPU, CpuDecode
from latentkv.attention.reference import REFERENCE, TorchReference
from latentkv.attention.triton.backend import TRITON, TritonDecode

__all__ = [
    "BACKENDS",
    "CPU",
    "REFERENCE",
    "TRITON",
    "AttentionBackend",
    "CpuDecode",
    "TorchReference",
    "TritonDecode",
    "backend_for",
    "register_backend",
]

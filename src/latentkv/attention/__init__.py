"""Attention backends: how a batch's queries read the latent caches (see base.py)."""

from latentkv.attention.base import BACKENDS, AttentionBackend, backend_for, register_backend
from latentkv.attention.reference import REFERENCE, TorchReference

__all__ = ["BACKENDS", "REFERENCE", "AttentionBackend", "TorchReference", "backend_for", "register_backend"]

"""Expert stores: where a MoE layer's routed experts live (see base.py for the contract)."""

from latentkv.experts.base import Expert, ExpertStore, StackedExperts
from latentkv.experts.resident import ResidentExperts

__all__ = ["Expert", "ExpertStore", "ResidentExperts", "StackedExperts"]

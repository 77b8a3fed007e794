"""Expert stores: where a MoE layer's routed experts live (see base.py for the contract)."""

from latentkv.experts.base import Expert, ExpertSource, ExpertStore, Job, LocalStore, StackedExperts
from latentkv.experts.resident import ResidentExperts

__all__ = ["Expert", "ExpertSource", "ExpertStore", "Job", "LocalStore", "ResidentExperts", "StackedExperts"]

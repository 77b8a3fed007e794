"""Routed experts: where the MoE layer gets the experts a batch routed to."""

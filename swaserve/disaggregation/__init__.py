"""Prefill/decode disaggregation (DESIGN §9.3): which pages travel, and the backends that
move them."""

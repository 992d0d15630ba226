"""Sampling: the sampler, penalty counts, grammar masks."""

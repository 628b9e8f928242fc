"""Runnable examples (not part of the installed `moe_jax`).

A regular package so that `examples.moe_lm` imports from the repository root (the tests do) even
when some installed distribution ships a top-level `examples` package of its own.
"""

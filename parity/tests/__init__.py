"""Tests of the parity package."""

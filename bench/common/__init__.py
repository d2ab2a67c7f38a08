"""Helpers shared by the benchmark scripts (not part of the product)."""

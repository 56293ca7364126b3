"""Tiny kernels the contract suite launches: one per kernel language."""

"""The CUDA prelude of the hal kernel sources (package data)."""

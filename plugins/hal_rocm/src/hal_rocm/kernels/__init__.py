"""The HIP prelude of the hal kernel sources (package data)."""

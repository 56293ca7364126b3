"""CUDA/HIP kernel sources shared by the GPU plugins (package data; see README.md here)."""

"""The saved GPU profiles the host-side tests check against (names as in hal_core's profiles)."""

from __future__ import annotations

NVIDIA_PROFILES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
                   "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA GeForce RTX 5090")
PROFILE_IDS = ("H100", "H200", "A100", "RTX4060L", "RTX5090")

"""The saved GPU profiles the host-side tests check against (names as in hal_core's profiles)."""

from __future__ import annotations

NVIDIA_PROFILES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
                   "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA GeForce RTX 5090")
NVIDIA_IDS = ("H100", "H200", "A100", "RTX4060L", "RTX5090")
#: CDNA3 (wave64, 304 CUs), CDNA2 (wave64, one GCD), RDNA3 (wave32, 48 WGPs).
AMD_PROFILES = ("AMD Instinct MI300X", "AMD Instinct MI250X", "Radeon RX 7900 XTX")
AMD_IDS = ("MI300X", "MI250X", "RX7900XTX")

GPU_PROFILES = NVIDIA_PROFILES + AMD_PROFILES
PROFILE_IDS = NVIDIA_IDS + AMD_IDS

"""Version of the hal-core distribution and of the HAL API it implements."""

from __future__ import annotations

__version__ = "0.1.0"

#: The HAL API version ``(major, minor)``. A plugin built for the same major
#: and a minor no newer than this one binds; any other is refused.
API_VERSION: tuple[int, int] = (1, 0)

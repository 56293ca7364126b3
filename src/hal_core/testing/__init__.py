"""The conformance kit: a contract suite every backend runs, and its pytest plugin (opt-in).

Run the suite with ``pytest -p hal_core.testing --pyargs hal_core.testing.suite --hal-backend=NAME``.

- :mod:`hal_core.testing.suite`: the tests (or ``from hal_core.testing.suite import *`` in a plugin's tests);
- this package is the pytest plugin (``-p hal_core.testing``; its code lives in
  :mod:`hal_core.testing.pytest_plugin`): ``--hal-backend``, ``--hal-seed``,
  ``--hal-allow-fallback``, the fixtures (``hal_backend``, ``hal_device``, ``hal_rng``,
  ``hal_seed``, ``hal_arrays``, ``hal_axpy_source``) and the check that fails a test in
  which a call the backend declares supported fell back;
- :mod:`hal_core.testing.inputs`: random op inputs and :func:`~hal_core.testing.inputs.assert_close`;
- :mod:`hal_core.testing.tolerances`: the one tolerance table.

Importing this package outside a pytest session imports no pytest (``hal
demo`` reads the tolerance table from here); inside one, the package
carries the plugin's hooks and fixtures, so ``-p hal_core.testing`` works.
"""

from __future__ import annotations

import sys

if "pytest" in sys.modules:  # inside a pytest session: this package is the plugin
    from .pytest_plugin import *  # noqa: F403 - the hooks and fixtures pytest looks up here
    from .pytest_plugin import __all__ as __all__  # the plugin names, for a star import

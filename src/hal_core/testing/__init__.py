"""The conformance kit: a contract suite every backend runs.

Run it with ``pytest --pyargs hal_core.testing.suite --hal-backend=NAME``.

- :mod:`hal_core.testing.suite`: the tests (or ``from hal_core.testing.suite import *`` in a plugin's tests);
- :mod:`hal_core.testing.pytest_plugin`: ``--hal-backend``, ``--hal-seed`` and the fixtures
  (``hal_backend``, ``hal_device``, ``rng``, ``hal_arrays``, ``hal_axpy_source``);
- :mod:`hal_core.testing.inputs`: random op inputs and :func:`~hal_core.testing.inputs.assert_close`;
- :mod:`hal_core.testing.tolerances`: the one tolerance table.
"""

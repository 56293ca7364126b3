"""The conformance kit: a contract suite every backend runs (``pytest --hal-backend=NAME``)."""

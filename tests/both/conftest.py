"""The tests of both Kerases: collected in every environment, each run with
the Keras of the session (``tests/flavour.py``), its name in the test id."""

import pytest

from tests.flavour import NAME


@pytest.fixture(autouse=True, params=[NAME])
def flavour(request) -> str:
    """Which Keras runs the test: ``"keras3"`` or ``"tf_keras"``."""
    return request.param

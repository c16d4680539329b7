"""Module-, class- and package-scoped fixtures are built once per worker
process: ``.ci/run``'s ``--dist loadgroup`` spreads single tests over the
workers, so the tests using one stay together on one worker (one group per
file), and every other test goes wherever a worker is free.

Kept apart from ``tests/conftest.py`` (which imports TensorFlow) so that
``tests/keras3/test_supported_versions.py`` can check the grouping in a small
pytest run of its own: pytest 9.2 broke it silently (pytest-xdist#1386).
"""

import pytest

_SHARED_SCOPES = {"class", "module", "package"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's, for every test
        closure = info.name2fixturedefs.values() if info else ()
        if any(d.scope in _SHARED_SCOPES for defs in closure for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

"""``Flavour.from_namespace``: a flavour module's record takes each field it
is not given from the module's private name for it, and refuses a field with
no value or with two."""

from __future__ import annotations

import dataclasses

import pytest

from gradient_accumulator.flavour import FLAVOUR
from gradient_accumulator.hosts.flavour import Flavour

FIELDS = [f.name for f in dataclasses.fields(Flavour)]


def test_fields_not_given_come_from_the_private_names():
    namespace = {f"_{name}": object() for name in FIELDS[2:]}
    record = Flavour.from_namespace(namespace, name="k", keras=None)
    assert record.name == "k"
    assert all(getattr(record, n) is namespace[f"_{n}"] for n in FIELDS[2:])


def test_a_missing_field_and_a_field_given_twice_are_named():
    namespace = {f"_{name}": object() for name in FIELDS[3:]}
    namespace["_name"] = "shadow"
    with pytest.raises(TypeError) as raised:
        Flavour.from_namespace(namespace, name="k")
    message = str(raised.value)
    assert f"Missing: ['keras', '{FIELDS[2]}']" in message
    assert "given twice: ['name']" in message


def test_the_keras_3_record_holds_its_module_hooks():
    from gradient_accumulator import flavour

    assert FLAVOUR.batch_norm_moments is flavour._batch_norm_moments
    assert FLAVOUR.merge_mask is flavour._merge_mask

"""``hosts.flavour.Flavour``: a Keras' flavour implements every hook, or it
cannot be made; the error names what it leaves out."""

from __future__ import annotations

import abc

import pytest

from gradient_accumulator.hosts.flavour import Flavour

METHODS = sorted(Flavour.__abstractmethods__)
VALUES = sorted(Flavour.__annotations__)


def _flavour_class(leave_out: str = "") -> type:
    """A Flavour subclass implementing every hook but ``leave_out``."""
    namespace = {name: None for name in VALUES if name != leave_out}
    for name in METHODS:
        if name != leave_out:
            namespace[name] = lambda self, *args: None
    return type("Partial", (Flavour,), namespace)


def test_a_flavour_with_every_hook_is_made():
    assert isinstance(_flavour_class()(), Flavour)
    assert len(METHODS) > 40 and len(VALUES) > 25  # both kinds are declared


@pytest.mark.parametrize("method", ["batch_norm_moments", "other_optimizer_wrapper"])
def test_a_left_out_method_is_refused_where_the_flavour_is_made(method):
    partial = _flavour_class(leave_out=method)
    assert method in partial.__abstractmethods__
    with pytest.raises(TypeError, match=method):
        partial()


@pytest.mark.parametrize("value", ["counts_calls", "loss_scaler"])
def test_a_left_out_value_is_refused_with_its_name(value):
    with pytest.raises(TypeError, match=rf"leaves out the values \['{value}'\]"):
        _flavour_class(leave_out=value)()


def test_methods_and_values_do_not_overlap():
    assert not set(METHODS) & set(VALUES)
    assert isinstance(Flavour, abc.ABCMeta)

"""tf-keras ``verify`` is the tf-keras host's, with the report types shared
with Keras 3 (the report itself: tests/both/test_verify.py)."""

from gradient_accumulator import LayerCheck, VariableCheck, VerifyReport, verify


def test_names_are_the_tf_keras_verify_and_shared_report_types():
    from gradient_accumulator import keras2
    from gradient_accumulator.hosts import equivalence

    assert verify is keras2.verify
    assert verify.__module__ == "gradient_accumulator.keras2.verify"
    assert VerifyReport is equivalence.VerifyReport
    assert (LayerCheck, VariableCheck) == (
        equivalence.LayerCheck,
        equivalence.VariableCheck,
    )

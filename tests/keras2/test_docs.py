"""The tf-keras page's Python blocks run as shown, where tf.keras is tf-keras
(the Keras 3 pages run in tests/keras3/test_snippets.py). Each page in a fresh
child process, forked from one that imported TensorFlow, tf-keras and the
package (``tests/preloaded.py``)."""

import pytest

from tests.keras3.test_snippets import KERAS2_PAGES, python_blocks, run_page_blocks
from tests.preloaded import Preloaded


@pytest.fixture(scope="module")
def children():
    preloaded = Preloaded("tensorflow", "tf_keras", "gradient_accumulator")
    yield preloaded
    preloaded.close()


@pytest.mark.parametrize("page", KERAS2_PAGES, ids=lambda p: p.name)
def test_tf_keras_page_code_blocks_run(page, tmp_path, children):
    assert [b for b in python_blocks(page) if b.not_run is None]
    run_page_blocks(page, tmp_path, children)

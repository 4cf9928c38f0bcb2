"""The examples in the public functions' docstrings run and print what they say."""

import doctest

import jax
import pytest

from jax_efc import ahead_of_time, device, ffi, grouped, mlp, ops, primitive


@pytest.mark.parametrize("module", [ops, mlp, primitive, device, ffi, ahead_of_time, grouped], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    if jax.default_backend() != "cpu":
        pytest.skip("the examples show what a CPU machine prints")
    failures, tried = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, report=True)
    assert tried > 0 and failures == 0

"""Shared fixtures: each framework's implementation, skipped (with the reason) where it cannot load."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import FRAMEWORKS, RosettaError, load_framework  # noqa: E402


def framework_or_skip(name):
    try:
        return load_framework(name)
    except RosettaError as err:
        pytest.skip(str(err))


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    return framework_or_skip(request.param)


@pytest.fixture(scope="session")
def digits():
    from common.data import load_dataset
    return load_dataset("digits")

"""The fixtures of the contract tests: every test runs once per block class."""
import pytest

from tests.contract.cases import CASES


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.label)
def case(request):
    """One of the six block classes (tests/contract/cases.py)."""
    yield request.param
    request.param.__dict__.pop("shared", None)  # its block goes with the module


@pytest.fixture
def block(case):
    """A new block of the case's class (weights of seed 3)."""
    return case.block()


@pytest.fixture
def x(case):
    """x of shape (B, L, d_model) = (2, 5, d_model)."""
    return case.x()

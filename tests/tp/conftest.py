import pytest

from tests.tp.pool import TPPool


@pytest.fixture(scope="module")
def tp2():
    pool = TPPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tp4():
    pool = TPPool(4)
    yield pool
    pool.close()

"""A backend module registered lazily by test_factory.py: it must stay unimported until create_engine."""

from tests.transfer.test_base import ListEngine


class FakeEngine(ListEngine):
    pass

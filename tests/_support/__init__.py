"""Helpers shared by the tests: data and models, statistical checks, runs, attacks.

Fixtures live in ``tests/conftest.py``; everything else that more than one
test module uses lives here, so that no test module imports another.
"""

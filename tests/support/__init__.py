"""Helpers shared by the tests and the benchmarks, imported as ``support.<module>``.

pytest puts tests/ on the path (``pythonpath`` in pyproject.toml); bench/common.py does the
same.  Fixtures stay in tests/conftest.py; what several test files share lives here, never
in a test file another test file imports.
"""

"""Importable helpers of the test suite.

``tests/`` is on ``sys.path`` (``pythonpath`` in pyproject's pytest settings), so test
modules and conftest files import ``support.<module>``.  Test modules never import each
other: what two of them share lives here, fixtures live in ``conftest.py`` files.
Subprocess entry points are modules here too, run as ``python -m support.<name>`` with
``support.process.child_env()``.
"""

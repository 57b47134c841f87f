"""Harnesses for tests, benchmarks and the quick start (``engine``: a real ``LMCacheEngine``
on CPU; ``gpu``: GPU readers on any device); not imported by the runtime path.
"""

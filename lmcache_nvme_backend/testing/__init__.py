"""Harnesses for tests, benchmarks and the quick start; not imported by the runtime path.

``engine`` drives a real ``LMCacheEngine`` on CPU with a connector that copies KV
bytes; ``gpu`` builds GPU readers on any device.  Both import torch and LMCache.
"""

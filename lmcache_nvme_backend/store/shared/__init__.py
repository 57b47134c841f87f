"""Shared mode (``nvme.shared: true``): one budget, LRU order and index for every process
on a cache directory, through files below its ``shared/`` folder (docs/deployment.md).
``tree.SharedTree`` is what the store holds (its docstring says what each module does);
each module imports only those after it in: ``tree``, ``member``, ``janitor``, ``share``,
``account``, then ``journal``, ``leases`` and ``ledger``, the files the members share.
"""

"""The three LMCache hooks (layer 5): thin translations between LMCache and the store.

``backend`` (``storage_plugins``), ``connector`` (``remote_storage_plugins``) and
``l2_adapter`` (``lmcache server --l2-adapter``) turn LMCache keys into key strings
and namespaces and memory objects into buffers (``memory_objects``), and share their
start-up chain (``_common``).  Storage decisions live in ``store``.
"""

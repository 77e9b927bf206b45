import history_store  # noqa: F401  (importing it drops stale numba kernel caches: see its kernel_cache)

from history_store.native.kernel_cache import guard as _guard_kernel_caches

_guard_kernel_caches()  # before any cached kernel loads: see kernel_cache

"""The native layer every kernel stands on, drafter and budget alike: named bundles of arrays (`bundles`), the one
allocator of dense per-request rows that every owner's arrays grow with (`dense_rows`), and the guard that drops
numba's stale on-disk kernel caches (`kernel_cache`)."""

"""The durable history store: RocksDB layout, values, window length statistics, checkpoints and backups."""

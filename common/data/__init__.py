"""Data: reading, embedding, partitions, per-worker shards, vocabularies."""

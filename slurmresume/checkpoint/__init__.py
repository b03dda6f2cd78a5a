"""The checkpoint format: layout (names), encoding (JSON), shard writer/reader, manifest, commit."""

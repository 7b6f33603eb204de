"""The native Ravex store (docs/format.md): ``reader`` (sniff, read, describe,
verify_chunks), ``check`` (every JSON file checked before use), ``store`` (the
lock, marker, manifest and sweep on either storage backend) and ``writer``
(append a checkpoint, prune), imported only when a store is written."""

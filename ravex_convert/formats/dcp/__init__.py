"""PyTorch Distributed Checkpoint (what FSDP2 and torchtitan save): ``reader``
(``.metadata`` through the allow-listing unpickler) and ``writer`` (imported
only when DCP is written)."""

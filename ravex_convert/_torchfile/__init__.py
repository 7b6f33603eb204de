"""``torch.save`` files without torch: ``unpickle`` (the allow-listing
unpickler), ``archive`` (the zip archive: where each storage's bytes are, their
CRC-32s) and ``write`` (pickles and zip layouts the writers emit)."""

"""One module per checkpoint format, each with the same small surface:
``sniff(path)`` (reasons if the layout matches, else None) and
``describe(path, reasons)`` (a :class:`~ravex_convert.info.CheckpointInfo`)."""

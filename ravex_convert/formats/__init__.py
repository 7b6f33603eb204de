"""The checkpoint formats, each with the same small surface: ``sniff(path)``
(reasons if the layout matches, else None), ``read`` (a
:class:`~ravex_convert.model.Checkpoint`, nothing loaded), ``describe(path,
reasons)`` (a :class:`~ravex_convert.info.CheckpointInfo`), and for a format
Ravex writes ``write`` with its options (:mod:`.options`). One module per
format, or one subpackage per family (``native/``, ``dcp/``, ``zero/``);
:mod:`.registry` lists them all, and nothing else names one."""

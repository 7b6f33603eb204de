"""Live checkpointing and exact resume of a training run (``@ravex.train_loop``).

Empty for now: the runtime issue builds it on top of ``ravex_convert``'s
native store. Imports go one way: ravex_runtime may use ravex_convert, never
the reverse.
"""

__all__: list[str] = []

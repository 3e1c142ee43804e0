"""What every layer may use: library-version shims (``compat``: TorchRec's and torch's
private attributes, in this one module), files written whole or not at all (``atomic``),
and how a process a signal ended is named (``signals``).

May import: nothing of hybridrec."""

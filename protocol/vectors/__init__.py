"""Wire-protocol test vectors; regenerate with `python -m protocol.vectors.generate`."""

"""Wire-protocol test vectors; regenerate with `python -m splitface.protocol.vectors.generate`."""

"""Simulated devices: N device processes (or Ray actors) training against one edge server, exporting their
programs with the export tool when a runtime needs them. A development tool above the device SDK and the
exporter; a phone runs the SDK alone."""

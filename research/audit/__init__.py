"""The curious edge server's audit (issue 6): attacks on what the server sees, and their metrics."""

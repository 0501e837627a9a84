"""The curious edge server's audit: attacks on what the server sees, and their metrics."""

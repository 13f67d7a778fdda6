"""The wire format and what ranks publish to each other, written once (host and kernels read it)."""

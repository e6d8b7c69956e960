"""One-off tools for experiments and refactors (not part of `make bench`)."""

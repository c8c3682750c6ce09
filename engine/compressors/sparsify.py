"""Sparsifiers, low-rank and sketch compressors (filled in by the compressor library, issue 3)."""
COMPRESSORS = {}

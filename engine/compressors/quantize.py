"""Quantizers and sign compressors (filled in by the compressor library, issue 3)."""
COMPRESSORS = {}

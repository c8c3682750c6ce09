"""Benchmarks that compare commlab with torch DDP in one run (see bench/common.py)."""

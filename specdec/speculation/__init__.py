"""Speculation: proposers, their controllers and router, behind one seam (speculator.py)."""

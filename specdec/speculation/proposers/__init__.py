"""Proposers: one file each, registered in specdec/speculation/registry.py."""

"""Falcon resources, one per route family."""

"""The Sequences window: many sequences sharing one pool."""

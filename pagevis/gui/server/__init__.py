"""The Server window: a simulated server (or a running pagevis serve) — its pool, forest, timeline and plots."""

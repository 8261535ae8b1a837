"""pagevis.simserver: a simulated server for the Server window and its bench — arrivals from a workload, one
engine stepped per server step, and the prefix forest of its pool. NumPy only, never Qt."""

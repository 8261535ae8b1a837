"""pagevis.serve: the HTTP API (FastAPI) over the engine and decoding sessions. Never imported by the core."""

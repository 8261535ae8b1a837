"""The attach window: another engine's KV events (vLLM, SGLang, pagevis serve) as a block forest."""

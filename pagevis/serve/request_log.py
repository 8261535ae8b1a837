"""`pagevis serve --request-log FILE`: one JSON object a line for each completion that ended, so that
`pagevis attach --play RECORDING --explain-log FILE` can explain it after the fact against the pool as it was:

    {"arrival": s since the epoch (time.time(), the clock of the KV event batches' ts), "prompt_token_ids": [...],
     "cached_tokens": n, "cache_salt": str | null, "takes_no_cache": true (a prompt scored with logprobs: it
     takes nothing from the prefix cache by design), "kv_events_endpoint": the server's --kv-events-endpoint}

The file is opened for appending when the server starts (a path that cannot be written is refused then) and
written a whole line at a time under a lock, flushed after each."""

from __future__ import annotations

import json
import threading


class RequestLog:
    def __init__(self, path: str, kv_events_endpoint: str | None) -> None:
        self._file = open(path, "a", encoding="utf-8")
        self._endpoint = kv_events_endpoint
        self._lock = threading.Lock()

    def write(self, arrival: float, prompt_ids, cached_tokens: int, cache_salt: str | None,
              takes_no_cache: bool) -> None:
        record = {"arrival": arrival, "prompt_token_ids": [int(t) for t in prompt_ids],
                  "cached_tokens": int(cached_tokens), "cache_salt": cache_salt,
                  "kv_events_endpoint": self._endpoint}
        if takes_no_cache:
            record["takes_no_cache"] = True
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

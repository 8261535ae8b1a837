"""pagevis.trace: trace files — one decode session kept on disk, to replay every view and scrub it exactly as
it was live. Writing and reading (file.py), the zip container (archive.py) and the format's schema
(schema.py); the format is described in docs/trace-format.md."""

from pagevis.trace.archive import TraceError
from pagevis.trace.file import SUFFIX, Trace, read_trace, record_differences, write_trace
from pagevis.trace.schema import FORMAT, VERSION

__all__ = ["FORMAT", "SUFFIX", "VERSION", "Trace", "TraceError", "read_trace", "record_differences", "write_trace"]

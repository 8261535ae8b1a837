"""A Prometheus /metrics endpoint on loopback for the attach tests: a real HTTP server in a thread."""

import contextlib
import http.server
import threading


@contextlib.contextmanager
def metrics_endpoint(body):
    """Serve body() (text, called per scrape) at http://127.0.0.1:PORT/metrics; yields that URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()

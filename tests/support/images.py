"""Made-up images, as a client sends them (``bench.vision``'s, with a default size)."""

from __future__ import annotations

from bench import vision

SIZE = (90, 70)  # (height, width): 6x4 patches of the embedded tiny-vl's processor


def png(seed: int, size: tuple[int, int] = SIZE) -> bytes:
    return vision.png(seed, size)


def data_url(seed: int, size: tuple[int, int] = SIZE) -> str:
    return vision.image_url(seed, size)


def image_part(seed: int, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed), "detail": detail}}


class ImageSite:
    """A loopback web server of images, for a profile that fetches image addresses:
    ``/<seed>.png`` is ``png(seed)``; ``/missing`` a 404; ``/big`` announces more bytes than
    any limit; ``/endless`` streams without announcing; ``/slow`` waits ``slow_s`` before
    answering and ``/drip`` takes as long a byte at a time; ``/moved`` redirects to
    ``/1.png`` on the host ``moved_to``, ``/loop`` to itself for ever (with an endless
    body)."""

    def __init__(self, slow_s: float = 3.0, moved_to: str = "127.0.0.1") -> None:
        import http.server
        import threading
        import time

        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                site.requests += 1
                path = self.path
                if path.endswith(".png") and path[1:-4].isdigit():
                    self._send(png(int(path[1:-4])))
                elif path == "/big":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 40))
                    self.end_headers()
                elif path == "/endless":
                    self.send_response(200)
                    self.end_headers()
                    self._endless()
                elif path == "/drip":  # a byte at a time, never quite timing out
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(int(slow_s * 10)):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass
                elif path == "/slow":
                    time.sleep(slow_s)
                    self._send(png(1))
                elif path == "/loop":  # for ever, an endless body with each redirect
                    self.send_response(302)
                    self.send_header("Location", f"http://{moved_to}:{site.port}/loop")
                    self.end_headers()
                    self._endless()
                elif path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", f"http://{moved_to}:{site.port}/1.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_error(404)

            def _endless(self) -> None:  # 256 MiB of zeros, or until the client leaves
                try:
                    for _ in range(4096):
                        self.wfile.write(b"\0" * 65536)
                except OSError:
                    pass

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

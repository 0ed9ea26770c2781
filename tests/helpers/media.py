"""Media for the tests: pictures and their data URLs, tiny videos encoded with PyAV, and a
real HTTP server on a free loopback port that serves fixed answers (a file, a redirect, a
slow response)."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB picture with a gradient (so a resize has something to interpolate)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    xs = np.mgrid[0:height, 0:width][1]
    pixels[..., 0] = ((xs * 255) // max(width - 1, 1)).astype(np.uint8) // 2 + pixels[..., 0] // 2
    return Image.fromarray(pixels, "RGB")


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_url(width: int = 150, height: int = 100, seed: int = 0, fmt: str = "PNG") -> str:
    return data_url(encoded(picture(width, height, seed), fmt), f"image/{fmt.lower()}")


def video_bytes(frames: int, rate: int, fmt: str = "mp4", width: int = 64, height: int = 48) -> bytes:
    """A video of `frames` frames at `rate` per second (frame i is gray level 8 * i)."""
    import av

    codec = {"mp4": "libx264", "webm": "libvpx"}[fmt]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.full((height, width, 3), i * 8 % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


@contextmanager
def media_server(routes: dict[str, tuple[int, dict[str, str], bytes, float]]) -> Iterator[tuple[int, list[str]]]:
    """A threaded HTTP server on 127.0.0.1 answering GET `path` with (status, headers, body,
    seconds to wait before the body); yields its port and the paths asked so far."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            status, headers, body, delay = routes.get(self.path, (404, {}, b"", 0.0))
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            time.sleep(delay)
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()

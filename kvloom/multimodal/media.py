"""Images from URLs, as chat ``image_url`` parts name them, with the server's limits.

- ``data:image/<type>;base64,<data>``: always allowed (the image travels inside the request).
- ``file://<path>``: only under ``allowed_local_media_path`` (after resolving links and ``..``); off by default.
- ``http(s)://<host>/...``: only when the host is in ``allowed_media_domains`` (exactly); off by default, so
  the server fetches nothing a client names (no server-side request forgery). Redirects are not followed
  (one could lead to a host not on the list), and a fetch stops after ``FETCH_TIMEOUT_SECONDS``.

Every image must be at most ``MAX_IMAGE_BYTES`` encoded and ``MAX_IMAGE_PIXELS`` decoded (checked from the
header, before the pixels are decoded) and must decode with Pillow. Whatever is wrong is a ``ValueError``
naming it and what is allowed.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MAX_IMAGE_PIXELS = 8192 * 8192  # a decoded image larger than this is refused before any resize
MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_SECONDS = 10.0


class MediaConnector:
    """Loads images from URLs under one engine's allowances."""

    def __init__(self, allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None) -> None:
        self.allowed_local_media_path = (None if allowed_local_media_path is None
                                         else os.path.realpath(allowed_local_media_path))
        self.allowed_media_domains = {d.lower() for d in allowed_media_domains or ()}

    def load_image(self, url: Any) -> Any:
        """The PIL image a URL names; ValueError when it is not allowed, too large or not an image."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"an image_url must be a non-empty string URL, got {type(url).__name__}")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(_data_url_bytes(url))
        if scheme == "file":
            return decode_image(self._local_bytes(url))
        if scheme in ("http", "https"):
            return decode_image(self._remote_bytes(url))
        raise ValueError(f"image URL scheme {scheme or url[:20]!r} is not supported; use a data:image/...;base64, "
                         f"URL, a file:// URL under --allowed-local-media-path, or an http(s) URL of a host in "
                         f"--allowed-media-domains")

    def _local_bytes(self, url: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError("local image files are not allowed; start the server with --allowed-local-media-path "
                             "DIR (LLM(allowed_local_media_path=DIR)) to allow the files under DIR")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// URL must name a local path, got host {parsed.netloc!r}")
        path = os.path.realpath(urllib.parse.unquote(parsed.path))
        root = self.allowed_local_media_path
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"image file {path!r} is outside the allowed local media path {root!r}")
        if not os.path.isfile(path):
            raise ValueError(f"image file {path!r} does not exist")
        size = os.path.getsize(path)
        if size > MAX_IMAGE_BYTES:
            raise ValueError(f"image file {path!r} has {size} bytes; at most {MAX_IMAGE_BYTES} are allowed")
        with open(path, "rb") as f:
            return f.read()

    def _remote_bytes(self, url: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in self.allowed_media_domains:
            allowed = sorted(self.allowed_media_domains)
            raise ValueError(f"image URL host {host!r} is not allowed; allowed hosts: {allowed} "
                             f"(--allowed-media-domains; none by default)")
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(url, timeout=FETCH_TIMEOUT_SECONDS) as response:
                data = response.read(MAX_IMAGE_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise ValueError(f"fetching the image URL failed: HTTP {e.code}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ValueError(f"fetching the image URL failed: {getattr(e, 'reason', e)}") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"the image at the URL is over {MAX_IMAGE_BYTES} bytes, the most allowed")
        return data


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        raise urllib.error.URLError("the server answered with a redirect, which is not followed")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise ValueError("a data URL image must look like data:image/<type>;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"the data URL's image is over {MAX_IMAGE_BYTES} bytes, the most allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's image is not valid base64") from None


def decode_image(data: bytes) -> Any:
    """Encoded bytes -> a decoded PIL image, its pixel count checked before the pixels are decoded."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data)} bytes; at most {MAX_IMAGE_BYTES} are allowed")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image has {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels are allowed")
        image.load()
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombError, SyntaxError, EOFError) as e:
        raise ValueError(f"the image could not be decoded ({type(e).__name__}); send a PNG, JPEG, GIF, WebP or "
                         f"another format Pillow reads") from None
    return image


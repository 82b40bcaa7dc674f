"""Images at web addresses, fetched only where the profile allows it: bounded in bytes
and in time, redirects held to the same hosts, never a local path."""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass(frozen=True)
class UrlFetch:
    """The profile's ``vision.fetch_urls`` (off: no web address is fetched)."""

    enabled: bool = False
    timeout_s: float = 10.0  # the whole fetch: connect, redirects and body
    hosts: tuple[str, ...] = ()  # host names allowed (empty: any host)


class FetchError(ValueError):
    """A 400: the address is not allowed, or its image could not be fetched."""


def _host_allowed(url: str, fetch: UrlFetch) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise FetchError("an image address must be an http(s) URL or a base64 data URL")
    host = parts.hostname.lower()
    if fetch.hosts and host not in fetch.hosts:
        raise FetchError(f"this server fetches images only from {', '.join(fetch.hosts)}, "
                         f"not from {host}: send the image as a base64 data URL")
    return host


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an address the request itself could have named."""

    def __init__(self, fetch: UrlFetch) -> None:
        self.fetch = fetch

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        _host_allowed(newurl, self.fetch)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image(url: str, fetch: UrlFetch, max_bytes: int) -> bytes:
    """The bytes at ``url``: over ``max_bytes`` (announced or read) or ``fetch.timeout_s``
    in all is a ``FetchError``, as is any HTTP error or an unreachable host."""
    if not fetch.enabled:
        raise FetchError("this server does not fetch images from the web: send the image "
                         "as a base64 data URL (data:image/png;base64,...)")
    _host_allowed(url, fetch)
    deadline = time.monotonic() + fetch.timeout_s
    opener = urllib.request.build_opener(_Redirects(fetch))
    request = urllib.request.Request(url, headers={"Accept": "image/*",
                                                   "User-Agent": "serve-app"})
    try:
        with opener.open(request, timeout=fetch.timeout_s) as response:
            announced = response.headers.get("Content-Length")
            if announced and announced.isdigit() and int(announced) > max_bytes:
                raise FetchError(f"the image at {url} is {announced} bytes, over the limit "
                                 f"of {max_bytes}")
            body = bytearray()
            while chunk := response.read1(CHUNK):  # what has come: a slow drip still ends
                body += chunk
                if len(body) > max_bytes:
                    raise FetchError(f"the image at {url} is over {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError
    except FetchError:
        raise
    except urllib.error.HTTPError as exc:
        raise FetchError(f"fetching the image at {url} failed: HTTP {exc.code}") from None
    except (TimeoutError, OSError) as exc:  # URLError is an OSError; so is a socket timeout
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            raise FetchError(f"fetching the image at {url} took over {fetch.timeout_s:g} s") \
                from None
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"could not fetch the image at {url}: {reason}") from None
    if time.monotonic() > deadline:
        raise FetchError(f"fetching the image at {url} took over {fetch.timeout_s:g} s")
    if not body:
        raise FetchError(f"the image at {url} is empty")
    return bytes(body)

"""Images at web addresses, fetched only where the profile allows it: bounded in bytes
and in time (redirects included), from the listed hosts or else from public addresses
only, redirects held to the same rule, never a local path.

A host is checked by the addresses it resolves to before the fetch; a name that resolves
to another address at connect time (DNS rebinding) is not caught: list the hosts
(``vision.fetch_hosts``) where that matters."""

from __future__ import annotations

import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

CHUNK = 64 * 1024
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class UrlFetch:
    """The profile's ``vision.fetch_urls`` (off: no web address is fetched)."""

    enabled: bool = False
    timeout_s: float = 10.0  # the whole fetch: connect, redirects and body
    hosts: tuple[str, ...] = ()  # host names allowed (empty: any public host)


class FetchError(ValueError):
    """A 400: the address is not allowed, or its image could not be fetched."""


def _host_allowed(url: str, fetch: UrlFetch) -> str:
    """The address's host when it may be fetched: in ``fetch.hosts`` where that names some;
    else any host whose every address is public (no loopback, private, link-local or
    reserved address: the server's own network is not the client's to read)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise FetchError("an image address must be an http(s) URL or a base64 data URL")
    host = parts.hostname.lower()
    if fetch.hosts:
        if host not in fetch.hosts:
            raise FetchError(f"this server fetches images only from "
                             f"{', '.join(fetch.hosts)}, not from {host}: send the image as "
                             "a base64 data URL")
        return host
    try:
        addresses = {str(a[4][0]) for a in socket.getaddrinfo(host, parts.port or 80,
                                                              proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        raise FetchError(f"could not fetch the image: {host} does not resolve") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
        raise FetchError(f"this server does not fetch images from {host}: it is not a public "
                         "address (list it in vision.fetch_hosts to allow it)")
    return host


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an address the request itself could have named, within
    the fetch's time, and never reads a redirect's body."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, fetch: UrlFetch, deadline: float) -> None:
        self.fetch, self.deadline = fetch, deadline

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        fp.close()  # urllib reads the body before following: nothing is left to read
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        _host_allowed(newurl, self.fetch)
        req.timeout = left  # the next hop has what is left of the fetch's time
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image(url: str, fetch: UrlFetch, max_bytes: int) -> bytes:
    """The bytes at ``url``: over ``max_bytes`` (announced or read) or ``fetch.timeout_s``
    in all is a ``FetchError``, as is any HTTP error or an unreachable host."""
    if not fetch.enabled:
        raise FetchError("this server does not fetch images from the web: send the image "
                         "as a base64 data URL (data:image/png;base64,...)")
    _host_allowed(url, fetch)
    deadline = time.monotonic() + fetch.timeout_s
    opener = urllib.request.build_opener(_Redirects(fetch, deadline))
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
        if 300 <= exc.code < 400:
            raise FetchError(f"fetching the image at {url} took over {MAX_REDIRECTS} "
                             "redirects") from None
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

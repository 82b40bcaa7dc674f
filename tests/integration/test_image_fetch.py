"""Image addresses fetched where the profile allows it (issue 42): from a real loopback web
server, bounded in bytes and time, redirects few, unread and held to the allowed hosts,
non-public addresses refused unless listed, every refusal a reason
(``serve_app/multimodal/fetch.py``; the served path is in test_vision_http)."""

from __future__ import annotations

import pytest

from serve_app.multimodal.fetch import UrlFetch
from serve_app.multimodal.images import ImageError, ImageLimits, image_bytes
from tests.support.images import ImageSite, png

# The site is on loopback: listed, as a profile must list a host that is not public.
ON = ImageLimits(max_bytes=1 << 20, fetch=UrlFetch(True, 1.0, ("127.0.0.1", "localhost")))


@pytest.fixture(scope="module")
def site():
    web = ImageSite(slow_s=3.0, moved_to="localhost")
    yield web
    web.close()


def test_an_allowed_address_gives_its_image(site):
    assert image_bytes(site.url("/2.png"), ON) == png(2)


def test_fetching_is_off_unless_the_profile_turns_it_on(site):
    before = site.requests
    with pytest.raises(ImageError, match="does not fetch"):
        image_bytes(site.url("/2.png"), ImageLimits())
    assert site.requests == before  # not even a connection


@pytest.mark.parametrize("path, words", [
    ("/missing", "HTTP 404"),
    ("/big", "over the limit of 1048576"),
    ("/endless", "over 1048576 bytes"),
])
def test_what_cannot_be_used_is_refused_with_a_reason(site, path, words):
    with pytest.raises(ImageError, match=words):
        image_bytes(site.url(path), ON)


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_a_slow_site_is_cut_at_the_timeout(site, path):
    """Both would answer within 3 s (the drip with bytes): only the 1 s limit refuses."""
    with pytest.raises(ImageError, match="took over 1 s"):
        image_bytes(site.url(path), ON)


def test_hosts_are_held_to_the_list_redirects_too(site):
    only_loopback = ImageLimits(fetch=UrlFetch(True, 1.0, ("127.0.0.1",)))
    assert image_bytes(site.url("/3.png"), only_loopback) == png(3)
    with pytest.raises(ImageError, match="only from 127.0.0.1, not from localhost"):
        image_bytes(site.url("/3.png", host="localhost"), only_loopback)
    with pytest.raises(ImageError, match="not from localhost"):  # /moved goes to localhost
        image_bytes(site.url("/moved"), only_loopback)
    assert image_bytes(site.url("/moved"), ON) == png(1)  # both listed: the redirect is followed


@pytest.mark.parametrize("address", ["http://127.0.0.1:9/a.png", "http://localhost/a.png",
                                     "http://10.1.2.3/a.png", "http://169.254.169.254/x",
                                     "http://[::1]/a.png"])
def test_without_a_host_list_only_public_addresses_are_fetched(address):
    any_public = ImageLimits(fetch=UrlFetch(True, 1.0))
    with pytest.raises(ImageError, match="not a public address"):
        image_bytes(address, any_public)


def test_redirects_are_few_and_their_bodies_unread(site):
    """``/loop`` redirects to itself with an endless body each time: refused after three
    redirects, quickly (a body read would take the whole fetch time)."""
    with pytest.raises(ImageError, match="over 3 redirects"):
        image_bytes(site.url("/loop"), ON)


def test_an_unreachable_host_is_a_reason_not_a_hang():
    with pytest.raises(ImageError, match="could not fetch"):
        image_bytes("http://127.0.0.1:9/a.png", ON)  # the discard port: nothing listens

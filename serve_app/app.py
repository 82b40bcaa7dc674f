"""``serve run``'s entry point (``serve_app.app:build_app``): the builder lives in
``serve_app.deploy.app``; this name is what profiles and users already type."""

from serve_app.deploy.app import build_app

__all__ = ["build_app"]

"""The ``serve-app`` command's parts: serving one model from flags, a running server's status."""

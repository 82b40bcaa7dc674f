"""``serve-app serve MODEL``: one model served without a YAML file written by hand.

The flags become a Serve config (the default profile's settings, one model) that goes
through the same validation as a file, then is written to the user's cache directory and
served by the lean start (``serve_app.cli.launch``) exactly as ``serve-app serve FILE.yaml``
would. A file, not an in-memory application, because ``serve run`` is what gives the
console, the Ctrl-C handling and the error messages users see for a profile, and because
the file printed on the console is a profile a user can copy and grow.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import yaml

from serve_app.config.catalog import EMBEDDED_PREFIX, embedded_names
from serve_app.config.paths import default_home
from serve_app.config.profile import ProfileError, load_serve_config

# Flags -> (where in the profile, the key): an error naming the key names the flag too.
FLAG_KEYS = {
    "context_length": "--context-length", "max_batch_size": "--max-batch-size",
    "api_keys_file": "--api-keys-file", "admin_keys_file": "--admin-keys-file",
    "ssd_dir": "--ssd-dir", "name": "--name", "task": "--task",
    "source": "MODEL", "port": "--port", "host": "--host",
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``serve MODEL`` (all optional: the default profile's settings)."""
    parser.add_argument("--name", help="the model's name in the API (default: from MODEL)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="prompt + answer tokens (default 4096; 8192 for smollm2)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="sequences decoded together (default 8)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="HTTP address (default 127.0.0.1; bind elsewhere only with "
                             "--api-keys-file)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--api-keys-file", default=None,
                        help="a file of API keys, one a line (mode 0600)")
    parser.add_argument("--admin-keys-file", default=None,
                        help="a file of admin keys (mode 0600): API keys that alone may use "
                             "the controls (/admin/*)")
    parser.add_argument("--ssd-dir", default=None,
                        help="the SSD cache directory (default ~/.cache/serve_app/kv)")
    parser.add_argument("--task", choices=("generate", "embed", "rerank"), default=None,
                        help="what the model serves: chat (generate), /v1/embeddings (embed), "
                             "/v1/rerank (rerank); default: from the checkpoint")


def looks_like_config(target: str) -> bool:
    return target.endswith((".yaml", ".yml")) or (Path(target).is_file())


def source_of(model: str) -> str:
    """MODEL as a profile source: ``smollm2-135m`` is the embedded model of that name."""
    if model.startswith(EMBEDDED_PREFIX):
        return model
    if model in embedded_names() and not Path(model).exists():
        return EMBEDDED_PREFIX + model
    if model.startswith(("/", ".", "~")) or Path(model).expanduser().exists():
        return str(Path(model).expanduser().resolve())
    return model


def model_name(source: str) -> str:
    """The API name: an embedded model's name, a directory's last part, a repo's id (as
    ``mlx_lm.server`` names it)."""
    if source.startswith(EMBEDDED_PREFIX):
        return source[len(EMBEDDED_PREFIX):]
    if source.startswith("/"):
        return Path(source.rstrip("/")).name or source
    return source


def build_config(model: str, args: argparse.Namespace) -> dict:
    """The Serve config of ``serve MODEL`` with these flags (not validated yet)."""
    source = source_of(model)
    entry: dict = {"name": args.name or model_name(source), "source": source,
                   "max_batch_size": args.max_batch_size, "max_queued_requests": 64,
                   "sampling": {"temperature": 0.0, "top_p": 1.0}, "num_cpus": 0}
    if getattr(args, "task", None) is not None:
        entry["task"] = args.task
    if args.context_length is not None:
        entry["context_length"] = args.context_length
    elif source.startswith(EMBEDDED_PREFIX) and "smollm2" in source:
        entry["context_length"] = 8192  # the model's own
    app_args: dict = {"models": [entry], "ingress": {"num_cpus": 0}}
    if args.api_keys_file:
        app_args["ingress"]["api_keys_file"] = str(Path(args.api_keys_file).expanduser())
    if args.admin_keys_file:
        app_args["ingress"]["admin_keys_file"] = str(Path(args.admin_keys_file).expanduser())
    if args.ssd_dir:
        app_args["cache_store"] = {"ssd_dir": str(Path(args.ssd_dir).expanduser())}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": args.host, "port": args.port},
        "applications": [{"name": "llm", "route_prefix": "/",
                          "import_path": "serve_app.app:build_app", "args": app_args}],
    }


def write_config(config: dict, home: Path | None = None) -> Path:
    """The config in ``$SERVE_APP_HOME/run/<model>.yaml``, validated (``ProfileError``
    naming the flag when one is wrong)."""
    name = config["applications"][0]["args"]["models"][0]["name"]
    http = config["http_options"]
    if not 1 <= int(http["port"]) <= 65535:
        raise ProfileError(f"--port: {http['port']} is not a TCP port (1 to 65535)")
    directory = (home or default_home()) / "run"
    directory.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    path = directory / f"{safe}.yaml"
    header = ("# Written by `serve-app serve` from its flags; copy it to grow a profile "
              "(docs/profiles.md).\n")
    trial = path.with_name(f".{safe}.{os.getpid()}.yaml")
    trial.write_text(header + yaml.safe_dump(config, sort_keys=False))
    try:
        load_serve_config(trial)
    except ProfileError as exc:
        trial.unlink()
        raise ProfileError(name_flags(str(exc).replace(f"{trial}: ", ""))) from None
    os.replace(trial, path)
    return path


def name_flags(message: str) -> str:
    """A profile error with the flag that set the key named in it."""
    for key, flag in FLAG_KEYS.items():
        if re.search(rf"\.{key}\b|\b{key}:", message):
            return f"{flag}: {message}"
    return message

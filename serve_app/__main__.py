"""Command line: ``check FILE``, ``materialize NAME``, ``gc [--apply]``, ``metrics-table``,
``local-cluster``."""

from __future__ import annotations

import argparse
import sys

from serve_app.profile import ProfileError, load_serve_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gc"]:
        from serve_app.gc import main as gc_main

        return gc_main(argv[1:])
    parser = argparse.ArgumentParser(prog="serve_app")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a Serve config file's profiles")
    check.add_argument("config")
    mat = sub.add_parser("materialize", help="build an embedded model and print its path")
    mat.add_argument("name")
    sub.add_parser("gc", help="report (and with --apply clean) an SSD cache directory")
    sub.add_parser("metrics-table", help="print the README's table of metrics")
    local = sub.add_parser("local-cluster",
                           help="run a Ray cluster of several nodes on this machine (to try "
                                "configs/qwen-cluster.yaml without several Macs)")
    local.add_argument("--nodes", type=int, default=2)
    local.add_argument("--ssd-root", default=None,
                       help="node i keeps its SSD cache in SSD_ROOT/node-i (default: "
                            "~/.cache/serve_app/cluster, created 0700)")
    args = parser.parse_args(argv)

    if args.command == "check":
        try:
            apps = load_serve_config(args.config)
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for name, profile in apps:
            models = ", ".join(m.name for m in profile.models)
            print(f"{args.config}: application {name!r} ok: {models}")
        return 0
    if args.command == "materialize":
        from serve_app.embedded import materialize

        try:
            print(materialize(args.name))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "local-cluster":
        from serve_app.cluster.local import run_local_cluster

        return run_local_cluster(args.nodes, args.ssd_root)
    if args.command == "metrics-table":
        from serve_app.metrics import markdown_table

        print(markdown_table(), end="")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``check FILE [--hub]``, ``materialize NAME``, ``gc [--apply]``,
``metrics-table``, ``sizing-table``, ``local-cluster``, ``serve FILE [--dashboard]``."""

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
    check = sub.add_parser("check", help="validate a Serve config file's profiles and print "
                                         "their memory plans (refused if one cannot fit)")
    check.add_argument("config")
    check.add_argument("--hub", action="store_true",
                       help="read the size of hub models missing from the local Hugging Face "
                            "cache from the hub (config.json and the file listing only)")
    check.add_argument("--mac-gb", type=int, default=None, metavar="GB",
                       help="plan for a Mac with this much memory (16, 32, 64, 128...) "
                            "instead of this machine")
    mat = sub.add_parser("materialize", help="build an embedded model and print its path")
    mat.add_argument("name")
    sub.add_parser("gc", help="report (and with --apply clean) an SSD cache directory")
    sub.add_parser("metrics-table", help="print the README's table of metrics")
    sub.add_parser("sizing-table", help="print the README's table of what fits on a Mac")
    lean = sub.add_parser("serve", help="`serve run CONFIG` on a local Ray started without "
                                        "its dashboard (~1 GB less resident memory)")
    lean.add_argument("config")
    lean.add_argument("--dashboard", action="store_true",
                      help="keep Ray's dashboard (UI, `ray list`, `serve status`)")
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
        return check_memory(args.config, apps, args.hub, args.mac_gb)
    if args.command == "serve":
        try:
            load_serve_config(args.config)  # a bad profile is refused before Ray starts
        except ProfileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        from serve_app.launch import serve

        return serve(args.config, dashboard=args.dashboard)
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
    if args.command == "sizing-table":
        from serve_app.sizing import sizing_table

        print(sizing_table(), end="")
        return 0
    if args.command == "metrics-table":
        from serve_app.metrics import markdown_table

        print(markdown_table(), end="")
        return 0
    return 2


def check_memory(config: str, apps: list, hub: bool, mac_gb: int | None = None) -> int:
    """Print each application's memory plan; 2 if one cannot fit (each reason on stderr).
    ``mac_gb``: plan for a Mac of that many GB (as the sizing table does), not this one."""
    from serve_app.memory import MachineMemory, describe, probe_machine
    from serve_app.planning import plan_profile

    machine = probe_machine() if mac_gb is None else MachineMemory(mac_gb << 30)
    refused = False
    for name, profile in apps:
        plan = plan_profile(profile, machine, hub)
        models = ", ".join(m.name for m in profile.models)
        verdict = "ok" if plan.fits else "REFUSED (memory)"
        print(f"{config}: application {name!r} {verdict}: {models}")
        for line in describe(plan):
            print(line)
        for note in plan.notes:
            print(f"  note: {note}")
        for problem in plan.problems:
            print(f"error: {config}: application {name!r}: memory: {problem}", file=sys.stderr)
        refused = refused or not plan.fits
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())

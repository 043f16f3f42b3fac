"""Command line: argument parsing -> config -> daemon. No logic of its own.

Every user mistake ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from neuronode.config import AVERAGINGS, CODECS, NodeConfig, flag_name, parse_hostport
from neuronode.config_sources import build_config
from neuronode.errors import ConfigError, NeuronodeError
from neuronode.security.ca_cli import add_ca_parser, run_ca

EXIT_USAGE = 2


class UsageError(Exception):
    """Raised by the parser instead of printing usage; becomes one line and exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (no usage dump) and takes no abbreviation of
    a flag: `--inner-step 5` is an unknown flag, as the same key in a TOML file is, never
    `--inner-steps 5`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per NodeConfig field, default None so we can tell 'not given' apart."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with options (keys as flag names)")
    for f in dataclasses.fields(NodeConfig):
        meta = f.metadata
        default = f.default
        shown = ",".join(default) if isinstance(default, tuple) else default
        if isinstance(default, bool):
            parser.add_argument(flag_name(f.name), dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction,
                                help=f"{meta['help']} (default: {'on' if default else 'off'})")
            continue
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            default=None,
            metavar=meta.get("metavar") or None,
            choices=meta.get("choices"),
            help=f"{meta['help']} (default: {shown!s})".replace("(default: )", "(default: none)"),
        )


def build_parser() -> Parser:
    start_help = "train, alone or with --peers; Ctrl-C / SIGTERM stops cleanly"
    parser = Parser(
        prog="neuronode",
        description="Peer-to-peer DiLoCo training daemon.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    start = sub.add_parser("start", help=start_help, description=start_help)
    add_config_flags(start)
    start.add_argument("--print-params", action="store_true",
                       help="build the task (model, tokenizer, data) as these flags say, print its parameter "
                            "count and tokens per round as JSON, and exit")
    status = sub.add_parser("status", help="print a node's status (JSON when piped or with --json)")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--data-dir", help="read a (stopped) node's last checkpoint in DIR")
    where.add_argument("--peer", metavar="HOST:PORT", help="ask a live node over gRPC")
    status.add_argument("--json", action="store_true", help="print JSON even on a terminal")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default: 5)")
    status.add_argument("--secret-file", help="the swarm secret, to ask a closed swarm's node from "
                        "another machine (default: none; loopback callers need none)")
    status.add_argument("--swarm-id", default="neuronode-default",
                        help="swarm id for --secret-file (default: neuronode-default)")
    status.add_argument("--tls-cert", help="certificate for a TLS swarm (default: none)")
    status.add_argument("--tls-key", help="key for a TLS swarm (default: none)")
    status.add_argument("--tls-ca", help="swarm CA for a TLS swarm (default: none)")
    add_bench_parser(sub)
    add_ca_parser(sub)
    add_model_parsers(sub)
    parser.epilog = "flags of 'neuronode start':\n" + start.format_help().split("options:", 1)[-1]
    return parser


def add_model_parsers(sub: Any) -> None:
    """`neuronode export` and `neuronode tokenizer train` (docs/models.md)."""
    export = sub.add_parser("export", help="write the swarm's model from a data dir's newest good checkpoint "
                            "as a model directory (Hugging Face for --task hf)")
    export.add_argument("--data-dir", required=True, help="a node's data dir (its checkpoints)")
    export.add_argument("--out", required=True, metavar="MODEL_DIR", help="folder to write the model to")
    tokenizer = sub.add_parser("tokenizer", help="tokenizers for --task hf")
    kinds = tokenizer.add_subparsers(dest="tokenizer", metavar="ACTION", parser_class=Parser)
    train = kinds.add_parser("train", help="train a byte-level BPE tokenizer on local text (needs the hf extra)")
    train.add_argument("--data", required=True, metavar="GLOB",
                       help="text shards: .txt, .jsonl or .parquet (or @FILE listing them)")
    train.add_argument("--vocab", required=True, type=int, metavar="N", help="vocabulary size (at least 257)")
    train.add_argument("--out", required=True, metavar="DIR", help="folder to write the tokenizer to")
    train.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    train.add_argument("--threads", type=int, default=0, metavar="N",
                       help="threads to train with (default: 0, every core)")


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print one JSON object")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=Parser)
    sync = kinds.add_parser("sync", help="average a P-parameter pseudo-gradient among N local nodes")
    sync.add_argument("--nodes", type=int, default=4, help="local node processes (default: 4)")
    sync.add_argument("--params", type=float, default=10e6, help="parameters P (default: 10e6)")
    sync.add_argument("--codec", default="fp32", choices=CODECS, help="wire codec (default: fp32)")
    for name, kind in (("sparse_k", int), ("sparse_bits", int), ("sparse_block", int), ("sparse_decay", float)):
        sync.add_argument(flag_name(name), type=kind, default=getattr(NodeConfig, name),
                          help=f"--codec sparse: the daemon's {flag_name(name)} (default: {getattr(NodeConfig, name)})")
    sync.add_argument("--max-upload-mbps", type=float, default=0.0,
                      help="every node's upload cap in Mbit/s, as the daemon's flag (default: 0, none)")
    sync.add_argument("--averaging", default="all-to-all", choices=AVERAGINGS,
                      help="averaging scheme, as the daemon's --averaging (default: all-to-all)")
    sync.add_argument("--rounds", type=int, default=3, help="rounds timed; the median is reported (default: 3)")
    sync.add_argument("--zstd-level", type=int, default=-1,
                      help="zstd level: -1 auto as the daemon (off when the link outruns zstd), 0 off, "
                           "up to 22 (default: -1)")
    sync.add_argument("--byte-shuffle", action=argparse.BooleanOptionalAction, default=NodeConfig.byte_shuffle,
                      help="split float bytes into planes before zstd, as the daemon (default: on)")
    sync.add_argument("--chunk-bytes", type=int, default=NodeConfig.chunk_bytes,
                      help=f"encoded bytes per chunk, as the daemon (default: {NodeConfig.chunk_bytes})")
    sync.add_argument("--no-gloo", action="store_true", help="skip the gloo reference")
    sync.add_argument("--grpc-floor", action="store_true",
                      help="also time bare grpc.aio moving the same bytes (what gRPC alone costs)")
    sync.add_argument("--secret-file", default="",
                      help="run the nodes as a closed swarm with this secret, to measure the cost of "
                           "authentication (default: none)")
    sync.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    # stdlib-only modules at import time (swarm imports torch when it runs): cheap to import
    from neuronode.bench import (
        api,
        catchup,
        membership,
        quality,
        stall,
        statesync,
        swarm,
        utilization,
    )

    quality.add_parser(kinds)
    statesync.add_parser(kinds)
    catchup.add_parser(kinds)
    membership.add_parser(kinds)
    utilization.add_parser(kinds)
    stall.add_parser(kinds)
    swarm.add_parser(kinds)
    api.add_parser(kinds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `neuronode` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        if args.command == "start":
            return run_start(args, argv)
        if args.command == "status":
            return run_status(args)
        if args.command == "ca":
            return run_ca(args)
        if args.command == "bench":
            return run_bench(args, parser)
        if args.command == "export":
            return run_export(args)
        if args.command == "tokenizer":
            return run_tokenizer(args)
        parser.print_help()
        return EXIT_USAGE
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except NeuronodeError as exc:
        print(f"neuronode: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `neuronode status | head`: the reader left; no traceback, nothing more to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run_start(args: argparse.Namespace, argv: Sequence[str]) -> int:
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(NodeConfig)}
    cfg = build_config(flags, config_file=args.config)
    if args.print_params:
        from neuronode.node.describe import describe

        print(json.dumps(describe(cfg), sort_keys=True))
        return 0
    from neuronode.node.member import launched  # heavy imports (torch) only when starting

    if cfg.local_workers > 1 and not launched():
        # One member of several processes: the launcher starts them (each runs `start ARGV`).
        from neuronode.node.console import setup_logging
        from neuronode.node.launch import launch_member

        setup_logging(cfg.log_format, cfg.log_level)
        code = launch_member(cfg, argv)
        # Its ranks are gone and wrote what they had to: skip tearing down torch (seconds).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from neuronode.node.run import run_daemon

    return run_daemon(cfg)


def run_status(args: argparse.Namespace) -> int:
    from neuronode.node import status as status_mod

    if args.peer:
        parse_hostport(args.peer, "--peer")
        report = status_mod.from_peer(args.peer, timeout_s=args.timeout, secret_file=args.secret_file,
                                      swarm_id=args.swarm_id, tls=(args.tls_cert, args.tls_key, args.tls_ca))
    else:
        report = status_mod.from_data_dir(args.data_dir or NodeConfig().data_dir)
    if args.json or not sys.stdout.isatty():
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(status_mod.format_table(report))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from neuronode.node.export import export

    result = export(args.data_dir, args.out, say=lambda line: print(f"neuronode export: {line}", file=sys.stderr))
    print(json.dumps(result, sort_keys=True))
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    if args.tokenizer != "train":
        raise UsageError("neuronode tokenizer: choose an action: train")
    if args.threads < 0:
        raise UsageError("neuronode tokenizer train: --threads must be 0 (every core) or more")
    from neuronode.training import TaskError
    from neuronode.training.tokenizer import train_tokenizer

    try:
        result = train_tokenizer(args.data, vocab_size=args.vocab, out=args.out, text_field=args.text_field,
                                 threads=args.threads)
    except TaskError as exc:
        raise ConfigError(f"tokenizer train: {exc}") from None
    print(json.dumps(result, sort_keys=True))
    return 0


def run_bench(args: argparse.Namespace, parser: Parser) -> int:
    if args.bench == "sync":
        from neuronode.bench.sync import run_sync_bench

        result = run_sync_bench(args)
    elif args.bench in ("quality", "utilization", "stall", "membership", "api", "statesync", "catchup"):
        from neuronode.bench import api, catchup, membership, quality, stall, statesync, utilization

        result = {"quality": quality, "utilization": utilization, "stall": stall,
                  "membership": membership, "api": api, "statesync": statesync, "catchup": catchup}[args.bench].run(args)
    elif args.bench == "swarm":
        from neuronode.bench import swarm

        result = swarm.run(args)
        if not args.json:  # the one benchmark with a table for a person
            print(swarm.format_table(result))
            return 0
    else:
        raise UsageError("neuronode bench: choose a benchmark: sync, quality, utilization, stall, swarm, "
                         "membership, api, statesync or catchup")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

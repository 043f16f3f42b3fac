"""`neuronode ca init` and `neuronode ca issue`: the command line of the swarm CA."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from neuronode.security.certs import (
    CA_CERT_FILE,
    CA_DAYS,
    NODE_DAYS,
    CertError,
    cert_hosts,
    create_ca,
    issue_node_cert,
    load_cert,
)


def add_ca_parser(sub: Any) -> None:
    """Add `ca init` and `ca issue` to the subparsers of `neuronode` (cli.build_parser)."""
    ca = sub.add_parser("ca", help="make the certificates of a closed swarm (mutual TLS)",
                        description="Make a swarm CA, then one certificate per node.")
    # type(ca): the parser class of the caller (cli.Parser turns mistakes into UsageError).
    actions = ca.add_subparsers(dest="ca_command", metavar="ACTION", parser_class=type(ca),
                                required=True)
    init = actions.add_parser("init", help="create the swarm's CA (ca.crt, ca.key)")
    init.add_argument("--out", required=True, type=Path, metavar="DIR",
                      help="folder for ca.crt and ca.key (created if missing)")
    init.add_argument("--swarm-id", required=True, help="the swarm's --swarm-id")
    init.add_argument("--days", type=int, default=CA_DAYS,
                      help=f"validity in days (default: {CA_DAYS})")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    issue = actions.add_parser("issue", help="issue one node's certificate and key")
    issue.add_argument("--ca", required=True, type=Path, metavar="DIR",
                       help="folder with ca.crt and ca.key")
    issue.add_argument("--out", required=True, type=Path, metavar="DIR",
                       help="folder for NODE.crt and NODE.key (created if missing)")
    issue.add_argument("--name", required=True, metavar="NODE", help="node name (certificate CN)")
    issue.add_argument("--host", required=True, action="append", dest="hosts", metavar="H",
                       help="DNS name or IP peers dial; repeat for more "
                            "(localhost and 127.0.0.1 are always added)")
    issue.add_argument("--days", type=int, default=NODE_DAYS,
                       help=f"validity in days (default: {NODE_DAYS})")
    issue.add_argument("--force", action="store_true", help="overwrite existing files")


def run_ca(args: argparse.Namespace) -> int:
    """Run `neuronode ca init|issue`; prints what was written and the flags to use."""
    if args.ca_command == "init":
        cert_path, key_path = create_ca(args.out, swarm_id=args.swarm_id, days=args.days,
                                        force=args.force)
        print(f"wrote {cert_path}  (swarm CA certificate: give it to every node)")
        print(f"wrote {key_path}  (CA key, mode 0600: keep it off the nodes; it admits members)")
        print(f"nodes of this swarm run with --swarm-id {args.swarm_id}")
        print(f"next: neuronode ca issue --ca {args.out} --out DIR --name NODE --host ADDRESS")
        return 0
    if args.ca_command == "issue":
        cert_path, key_path = issue_node_cert(args.ca, args.out, node_name=args.name,
                                              hosts=args.hosts, days=args.days, force=args.force)
        expires = load_cert(cert_path, "certificate").not_valid_after_utc
        print(f"wrote {cert_path}  (valid until {expires:%Y-%m-%d}; "
              f"hosts: {', '.join(cert_hosts(cert_path))})")
        print(f"wrote {key_path}  (node key, mode 0600)")
        print("start the node with:")
        print(f"  --tls-cert {cert_path} --tls-key {key_path} --tls-ca {args.ca / CA_CERT_FILE}")
        return 0
    raise CertError("neuronode ca: choose an action: init, issue")



"""What a Hello may say: sizes within the wire's bounds, rounds below 2^53, our swarm, protocol,
settings and model, an id not banned here and not our own. Every refusal names the fix."""

from __future__ import annotations

from neuronode.swarm.context import Context, Settings
from neuronode.swarm.links.relay import MAX_CARRIERS
from neuronode.swarm.receipts.wire import check_sizes as check_receipt_sizes
from neuronode.swarm.wire import (
    MAX_ADDRESS_CHARS,
    MAX_ID_CHARS,
    MAX_SETTING_NAME_CHARS,
    MAX_SETTING_VALUE_CHARS,
    MAX_TASK_SETTINGS,
    PROTOCOL_VERSION,
    Refusal,
    settings_fields,
)
from neuronode.v1 import node_pb2 as pb

MAX_ROUND = 2**53  # rounds a Hello may name (any arithmetic on them stays exact in a double)


def check_info(info: pb.NodeInfo, ctx: Context) -> None:
    """Refuse a peer of another swarm, protocol or model, with the fix in the message."""
    cfg = ctx.cfg
    if (not info.node_id or len(info.node_id) > MAX_ID_CHARS or len(info.swarm_id) > MAX_ID_CHARS
            or len(info.advertise) > MAX_ADDRESS_CHARS or len(info.manifest_hash) > MAX_ID_CHARS
            or len(info.param_digest) > MAX_ID_CHARS or len(info.recent_digests) > 64
            or any(len(d.param_digest) > MAX_ID_CHARS or len(d.momentum_digest) > MAX_ID_CHARS
                   for d in info.recent_digests)
            or len(info.settings.averaging) > MAX_ID_CHARS or len(info.settings.aggregator) > MAX_ID_CHARS
            or len(info.carried_by) > MAX_CARRIERS or any(len(c) > MAX_ID_CHARS for c in info.carried_by)
            or len(info.settings.task) > MAX_TASK_SETTINGS
            or any(len(t.name) > MAX_SETTING_NAME_CHARS or len(t.value) > MAX_SETTING_VALUE_CHARS
                   for t in info.settings.task)):
        raise Refusal("INVALID_ARGUMENT", "hello needs a node id and swarm id of at most 128 characters, "
                      f"an address of at most 256, at most 64 recent digests, {MAX_CARRIERS} carriers "
                      f"and {MAX_TASK_SETTINGS} task settings (names of at most 64 characters, values of 128)")
    check_receipt_sizes(info)
    rounds = [info.round, info.contributes_from, *(d.round for d in info.recent_digests),
              *(r.round for r in [*info.receipts, *info.disputed]), *(e.round for e in info.echoes)]
    if max(rounds) >= MAX_ROUND:
        raise Refusal("INVALID_ARGUMENT", f"hello names round {max(rounds)}; rounds are below 2^53")
    if info.swarm_id != cfg.swarm_id:
        raise Refusal("FAILED_PRECONDITION",
                      f"swarm id mismatch: {info.node_id} is in swarm '{info.swarm_id}', this node "
                      f"({cfg.node_id}) is in '{cfg.swarm_id}'; start both with the same --swarm-id")
    if info.protocol_version != PROTOCOL_VERSION:
        raise Refusal("FAILED_PRECONDITION",
                      f"protocol version mismatch: {info.node_id} speaks v{info.protocol_version}, "
                      f"this node v{PROTOCOL_VERSION}; run the same neuronode release")
    # Named settings first: a different size or tokenizer is named, not reported as another manifest.
    differs = cfg.settings.mismatch(Settings(**settings_fields(info.settings)))
    if differs is not None:
        flag, theirs, ours = differs
        raise Refusal("FAILED_PRECONDITION",
                      f"settings mismatch: {info.node_id[:MAX_ID_CHARS]} runs {flag} {theirs[:64]}, this node "
                      f"({cfg.node_id}) {flag} {ours}; every member of a swarm needs the same {flag}"
                      f"{Settings.HINTS.get(flag, '')}")
    if info.manifest_hash != cfg.manifest_hash:
        raise Refusal("FAILED_PRECONDITION",
                      f"model manifest mismatch: {info.node_id} trains another model "
                      f"({info.manifest_hash[:12]} vs {cfg.manifest_hash[:12]} here); "
                      "use the same --task and model-size flags on every node")
    if banned := ctx.table.banned_for(info.node_id):
        raise Refusal("PERMISSION_DENIED", f"{info.node_id[:MAX_ID_CHARS]} is banned here for {banned:.0f} more "
                      "seconds: it signed two different versions of one contribution or receipt")
    if info.node_id == cfg.node_id and info.advertise != ctx.advertise:
        raise Refusal("ALREADY_EXISTS",
                      f"node id {info.node_id} is already used by the node at {ctx.advertise}; "
                      "give every node its own --data-dir or --node-id")

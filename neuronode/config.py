"""One typed, frozen node configuration.

Every option is a field of `NodeConfig`; its metadata (help text, choices) builds the CLI flags,
the `NEURONODE_*` environment variables and the keys of `--config node.toml`
(neuronode.config_sources reads those and merges them: flag > environment > config file >
default). Validation errors are `ConfigError`s naming the
flag and the fix; the CLI prints them as one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronode.errors import ConfigError

CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "sparse")
AGGREGATORS = ("mean", "trimmed-mean", "median", "norm-clip", "centered-clip")
AVERAGINGS = ("all-to-all", "reduce-scatter", "gather")
DEVICES = ("auto", "cpu", "cuda", "mps")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


def opt(default: Any, help: str, *, choices: tuple[str, ...] | None = None, metavar: str = "") -> Any:
    """A config field with the metadata the CLI, environment and TOML loaders use."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar})


def parse_hostport(value: str, flag: str) -> tuple[str, int]:
    """Split HOST:PORT (IPv6 as [::1]:PORT); raise ConfigError naming `flag` when malformed."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ConfigError(f"{flag}: '{value}' is not HOST:PORT (for example 127.0.0.1:7420)")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}: port {port} in '{value}' is outside 0-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{flag}: '{value}' has a malformed IPv6 address") from None
    elif any(c.isspace() or c in "/[]" for c in host):
        raise ConfigError(f"{flag}: '{value}' has a malformed host")
    return host, port


@dataclass(frozen=True)
class NodeConfig:
    """Everything `neuronode start` needs. Field names map to --flags-with-dashes."""

    data_dir: str = opt("neuronode-data", "folder for the node id, checkpoints and state", metavar="DIR")
    node_id: str = opt("", "this node's id; empty: the id its key derives (key and id kept in the data dir)")
    swarm_id: str = opt("neuronode-default", "name of the swarm; peers with another swarm id are refused")
    listen: str = opt("127.0.0.1:7420", "address to serve gRPC on (port 0 picks a free port)", metavar="HOST:PORT")
    advertise: str = opt("", "address peers should dial; empty: --listen's, or with a wildcard --listen "
                         "(0.0.0.0) the host peers see us at, confirmed by a dial-back", metavar="HOST:PORT")
    reachable: str = opt("auto", "whether peers can dial us: auto asks them to dial back; no (behind NAT, "
                         "nothing forwarded) takes part through sessions to reachable members",
                         choices=("auto", "yes", "no"))
    secret_file: str = opt("", "file with the swarm's shared secret: closes the swarm to members who know it", metavar="FILE")
    tls_cert: str = opt("", "this node's certificate (mutual TLS; see `neuronode ca`)", metavar="FILE")
    tls_key: str = opt("", "this node's private key (mutual TLS)", metavar="FILE")
    tls_ca: str = opt("", "the swarm CA certificate that peers' certificates must chain to", metavar="FILE")
    open: bool = opt(False, "allow listening on a non-loopback address without --secret-file or TLS")
    peers: tuple[str, ...] = opt((), "comma list of bootstrap peers; one live peer is enough", metavar="HOST:PORT,...")
    task: str = opt("bytelm", "built-in task name or a plug-in 'package.module:factory'")
    task_option: tuple[str, ...] = opt((), "comma list of KEY=VALUE options passed to the task", metavar="K=V,...")
    model: str = opt("", "--task hf: folder with the model's config.json (and weights to start from); "
                     "the same as --task-option model=DIR", metavar="DIR")
    tokenizer: str = opt("", "--task hf: tokenizer folder (from `neuronode tokenizer train`), or 'bytes'; "
                         "the same as --task-option tokenizer=DIR", metavar="DIR")
    data: str = opt("", "--task hf: training text: a folder, a glob of .txt/.jsonl/.parquet shards, or @FILE "
                    "listing them; the same as --task-option data=...", metavar="GLOB")
    val_data: str = opt("", "--task hf: validation shards instead of a held-out share of --data; the same "
                        "as --task-option val_data=...", metavar="GLOB")
    rounds: int = opt(0, "stop after this many completed rounds in total (0: run until stopped)")
    inner_steps: int = opt(50, "inner optimizer steps per round (H)")
    round_seconds: float = opt(0.0, "also end a round's training after this many seconds (0: steps only)")
    batch_size: int = opt(16, "sequences per inner step")
    seq_len: int = opt(128, "tokens per sequence")
    d_model: int = opt(128, "model width of the built-in task")
    n_layers: int = opt(4, "transformer blocks of the built-in task")
    n_heads: int = opt(4, "attention heads of the built-in task")
    inner_lr: float = opt(3e-3, "peak inner AdamW learning rate")
    weight_decay: float = opt(0.1, "inner AdamW weight decay")
    warmup_steps: int = opt(-1, "linear warm-up steps (-1: 5%% of the schedule)")
    schedule_steps: int = opt(0, "cosine schedule length in inner steps (0: rounds x inner-steps, or 10000)")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of --inner-lr")
    grad_clip: float = opt(1.0, "clip gradient norm to this (0: off)")
    grad_accum: int = opt(1, "micro-batches accumulated per inner step")
    outer_lr: float = opt(-1.0, "outer learning rate (-1: 0.7, or 3.0 with --codec sparse)")
    outer_momentum: float = opt(-1.0, "outer Nesterov momentum (-1: 0.9, or 0 with --codec sparse: plain SGD)")
    seed: int = opt(0, "model-initialisation seed (must match across the swarm)")
    threads: int = opt(0, "torch threads for this node (0: half the cores, at most 8)")
    device: str = opt("auto", "where to train", choices=DEVICES)
    local_workers: int = opt(1, "processes this member trains with, one per GPU: data-parallel inside "
                             "(DistributedDataParallel), one member to the swarm (docs/multi-gpu.md)")
    max_local_workers: int = opt(1, "the most processes one member of the swarm may train with (a swarm "
                                 "setting, alike on every member: a member's contribution weighs its "
                                 "samples, at most this many times one process's)")
    max_restarts: int = opt(0, "with --local-workers: how often the member is restarted from its checkpoint "
                            "after one of its processes failed")
    codec: str = opt("bf16", "how pseudo-gradients are encoded on the wire (sparse: the k largest of each "
                     "block, few bits each, about 50x fewer bytes than bf16; all-to-all or gather)", choices=CODECS)
    sparse_k: int = opt(64, "--codec sparse: entries kept per block (1 to 1024, at most --sparse-block)")
    sparse_bits: int = opt(2, "--codec sparse: bits per kept value, sign included (2, 4 or 8)")
    sparse_block: int = opt(4096, "--codec sparse: elements per block (64 to 65536)")
    sparse_decay: float = opt(0.95, "--codec sparse: error feedback keeps this share of what was not sent, "
                              "per round (in (0, 1])")
    averaging: str = opt("gather", "all-to-all: everyone sends everyone its contribution; reduce-scatter: "
                         "member i averages shard i (about 2x one contribution sent, whatever the swarm size); "
                         "gather: a round averages --gather-makers members' contributions, spread by "
                         "forwarding, the others' wait in error feedback (flat per member in the swarm size)",
                         choices=AVERAGINGS)
    gather_makers: int = opt(32, "--averaging gather: contributions a round averages at most (its makers, "
                             "drawn anew each round; a swarm of at most this many averages everyone's)")
    aggregator: str = opt("norm-clip", "how contributions are combined: norm-clip bounds each member's influence "
                          "(any --averaging, any --codec); mean trusts every member", choices=AGGREGATORS)
    aggregator_option: tuple[str, ...] = opt(
        (), "comma list of aggregator options: trim_fraction, clip_factor, iterations, cosine_threshold",
        metavar="K=V,...")
    max_weight: float = opt(0.0, "the most samples one member's contribution may claim per round; every member "
                            "needs the same (0: inner-steps x batch-size x grad-accum x max-local-workers)")
    zstd_level: int = opt(-1, "zstd level for contribution chunks (0: off, -1: auto by measured link speed)")
    byte_shuffle: bool = opt(True, "split float bytes into planes before zstd (compresses float codecs ~15%% better)")
    chunk_bytes: int = opt(1 << 20, "encoded bytes per contribution chunk")
    overlap: bool = opt(False, "sync round r in the background while round r+1 trains (one-round-delayed outer step)")
    max_upload_mbps: float = opt(0.0, "cap on what this node sends, in megabits per second (0: no cap)")
    max_relay_mbps: float = opt(-1.0, "cap on what this node forwards between members nobody can dial (behind "
                                "NAT), in megabits per second (-1: half of --max-upload-mbps, or no cap without "
                                "one; 0: no cap)")
    sync_timeout: float = opt(60.0, "seconds to wait for peers' contributions once ours is sent")
    min_peers: int = opt(1, "contributors (self included) a round needs; with fewer the node waits for more")
    heartbeat_s: float = opt(2.0, "seconds between heartbeats to each peer")
    metrics_port: int = opt(0, "serve Prometheus metrics (/metrics) and the status page (/) on this port of the "
                            "--listen host (0: off)")
    page_show_addresses: bool = opt(False, "show peers' addresses on the status page and /api/* also when "
                                    "--metrics-port listens beyond loopback (hidden there by default)")
    keep_checkpoints: int = opt(3, "checkpoints kept in the data dir")
    max_ids_per_host: int = opt(16, "live node ids one host (an IP address the node saw; an IPv6 /64) may hold in this node's peer table")
    repair_cooldown: int = opt(3, "rounds between two repairs of a diverged replica (catching up is never delayed)")
    fault_file: str = opt("", "testing only: JSON fault plan for the transport (docs/fault-tolerance.md)", metavar="FILE")
    log_format: str = opt("text", "log line format", choices=LOG_FORMATS)
    log_level: str = opt("info", "log verbosity", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            validate_field(f.name, getattr(self, f.name), f.metadata)
        object.__setattr__(self, "task_option", fold_task_flags(self))
        check_averaging(self.codec, self.averaging)
        if self.sparse_k > self.sparse_block:
            raise ConfigError(f"--sparse-k {self.sparse_k} must be at most --sparse-block {self.sparse_block}")
        tls = [self.tls_cert, self.tls_key, self.tls_ca]
        if any(tls) and not all(tls):
            raise ConfigError("--tls-cert, --tls-key and --tls-ca go together; give all three")
        if self.d_model % self.n_heads:
            raise ConfigError(f"--d-model {self.d_model} must be divisible by --n-heads {self.n_heads}")
        self.check_local_workers(self.local_workers)
        if self.max_restarts and self.local_workers == 1:
            raise ConfigError("--max-restarts restarts a member of --local-workers 2 or more; a single "
                              "process is restarted by its service manager (systemd, docker)")

    def task_options(self) -> dict[str, str]:
        """--task-option as the task gets it (--model, --tokenizer, --data, --val-data folded in)."""
        return dict(kv.split("=", 1) for kv in self.task_option)

    def tokens_per_round(self, tokens_per_batch: int) -> int:
        """Tokens one member trains on in a round: inner steps x micro-batches x processes."""
        return tokens_per_batch * self.inner_steps * self.grad_accum * self.local_workers

    def check_local_workers(self, workers: int, *, how: str = "--local-workers") -> None:
        """A member may train with at most --max-local-workers processes (the swarm's setting)."""
        if workers > self.max_local_workers:
            raise ConfigError(f"{how} {workers} is more than --max-local-workers {self.max_local_workers}; "
                              f"a swarm that admits such members runs with --max-local-workers {workers} "
                              "on every member")

    def outer(self) -> tuple[float, float]:
        """(--outer-lr, --outer-momentum) with -1 resolved: the outer step measured best for
        the codec (docs/benchmarks.md, "The sparse codec")."""
        lr, momentum = OUTER_DEFAULTS["sparse" if self.codec == "sparse" else "dense"]
        return (lr if self.outer_lr == -1 else self.outer_lr,
                momentum if self.outer_momentum == -1 else self.outer_momentum)

    @property
    def authenticated(self) -> bool:
        """Whether peers must prove membership (shared secret and/or mutual TLS)."""
        return bool(self.secret_file or self.tls_cert)

    def weight_bound(self, samples_per_batch: int) -> float:
        """--max-weight resolved: 0 is what an honest member of the most processes the swarm admits
        trains on in a round (inner steps x samples per batch x grad-accum x --max-local-workers);
        a member with another --batch-size claims at most this."""
        return self.max_weight or float(self.inner_steps * samples_per_batch * self.grad_accum
                                        * self.max_local_workers)

    def relay_mbps(self) -> float:
        """--max-relay-mbps resolved: -1 is half of --max-upload-mbps (0, no cap, without one)."""
        return self.max_upload_mbps / 2 if self.max_relay_mbps == -1 else self.max_relay_mbps

    def check_exposure(self) -> None:
        """Protected mode: without authentication, serve loopback only unless --open says so."""
        host, _ = parse_hostport(self.listen, "--listen")
        if self.authenticated or self.open or is_loopback_host(host):
            return
        raise ConfigError(
            f"--listen {self.listen} would let anyone on the network join this swarm without "
            "authentication; close it with --secret-file FILE (or --tls-cert/--tls-key/--tls-ca), "
            "or add --open to accept that")

    @property
    def advertise_address(self) -> str:
        """The address peers dial: --advertise, else --listen's; "" for a wildcard --listen
        (0.0.0.0), whose address the node learns from its peers once it runs."""
        if self.advertise:
            return self.advertise
        host, port = parse_hostport(self.listen, "--listen")
        if is_wildcard_host(host):
            return ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


POSITIVE_INT = {"inner_steps", "batch_size", "seq_len", "d_model", "n_layers", "n_heads",
                "grad_accum", "min_peers", "chunk_bytes", "keep_checkpoints", "local_workers",
                "max_local_workers"}
NON_NEGATIVE_INT = {"rounds", "threads", "schedule_steps", "seed", "max_restarts"}
POSITIVE_FLOAT = {"inner_lr", "sync_timeout", "heartbeat_s"}
# The outer step's defaults (--outer-lr, --outer-momentum -1): Nesterov for the dense codecs,
# plain SGD with a larger step for the sparse one, whose error feedback acts as momentum.
OUTER_DEFAULTS = {"dense": (0.7, 0.9), "sparse": (3.0, 0.0)}
RANGES: dict[str, tuple[Any, str]] = {
    "warmup_steps": (lambda v: v >= -1, "-1 (auto) or more"),
    "seed": (lambda v: 0 <= v < 2**31, "between 0 and 2147483647"),
    "weight_decay": (lambda v: v >= 0, "0 or more"),
    "grad_clip": (lambda v: v >= 0, "0 (off) or more"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "between 0 and 1"),
    "outer_lr": (lambda v: v == -1 or v > 0, "greater than 0, or -1 (the codec's default)"),
    "outer_momentum": (lambda v: v == -1 or 0 <= v < 1, "in [0, 1), or -1 (the codec's default)"),
    "zstd_level": (lambda v: -1 <= v <= 22, "-1 (auto), 0 (off) or a level up to 22"),
    "round_seconds": (lambda v: v >= 0, "0 (off) or more"),
    "max_upload_mbps": (lambda v: v >= 0, "0 (no cap) or more"),
    "max_relay_mbps": (lambda v: v == -1 or v >= 0, "-1 (half of --max-upload-mbps), 0 (no cap) or more"),
    "metrics_port": (lambda v: 0 <= v <= 65535, "a port between 1 and 65535, or 0 (off)"),
    "repair_cooldown": (lambda v: v >= 0, "0 or more"),
    "max_ids_per_host": (lambda v: v >= 1, "1 or more"),
    "max_weight": (lambda v: 0 <= v < 1e15, "0 (inner-steps x batch-size x grad-accum x max-local-workers) or a sample count below 1e15"),
    "chunk_bytes": (lambda v: 4096 <= v <= 4 << 20, "between 4096 and 4194304 bytes"),
    "sparse_k": (lambda v: 1 <= v <= 1024, "between 1 and 1024"),
    "sparse_bits": (lambda v: v in (2, 4, 8), "2, 4 or 8"),
    "sparse_block": (lambda v: 64 <= v <= 65536, "between 64 and 65536"),
    "sparse_decay": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "gather_makers": (lambda v: 2 <= v <= 256, "between 2 and 256"),
}


# Flags that are task options of --task hf: `--model DIR` is `--task-option model=DIR`.
TASK_FLAGS = ("model", "tokenizer", "data", "val_data")


def fold_task_flags(cfg: NodeConfig) -> tuple[str, ...]:
    """--task-option with --model, --tokenizer, --data and --val-data added (a value may hold
    commas here, unlike in --task-option); the same option given both ways must agree."""
    given = {name: getattr(cfg, name) for name in TASK_FLAGS if getattr(cfg, name)}
    if given and cfg.task in ("bytelm", "builtin"):
        raise ConfigError(f"{', '.join(flag_name(n) for n in given)}: options of --task hf (the built-in "
                          "task takes none); add --task hf")
    options = cfg.task_options()
    for name, value in given.items():
        if options.get(name, value) != value:
            raise ConfigError(f"{flag_name(name)} {value} and --task-option {name}={options[name]} disagree; "
                              "give one of them")
    return tuple(kv for kv in cfg.task_option if kv.split("=", 1)[0] not in given) + tuple(
        f"{name}={value}" for name, value in given.items())


def check_averaging(codec: str, averaging: str) -> None:
    """--codec sparse averages all-to-all or gather only (a ConfigError saying why otherwise)."""
    if codec == "sparse" and averaging == "reduce-scatter":
        raise ConfigError("--codec sparse needs --averaging all-to-all or gather: under reduce-scatter a reducer's "
                          "averaged shard is the union of the members' kept entries, up to N times denser, "
                          "and re-encoding it sparse would drop most of it")


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard_host(host: str) -> bool:
    """0.0.0.0 and friends: listening everywhere says nothing about where peers reach us."""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_field(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    """Range checks for one field; raises ConfigError naming the flag."""
    flag = flag_name(name)
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{flag}: '{value}' is not one of {', '.join(meta['choices'])}")
    if name in POSITIVE_INT and value < 1:
        raise ConfigError(f"{flag} must be a positive integer (got {value})")
    if name in NON_NEGATIVE_INT and value < 0:
        raise ConfigError(f"{flag} must be 0 or more (got {value})")
    if name in POSITIVE_FLOAT and not value > 0:
        raise ConfigError(f"{flag} must be greater than 0 (got {value})")
    in_range = RANGES.get(name)
    if in_range and not in_range[0](value):
        raise ConfigError(f"{flag} must be {in_range[1]} (got {value})")
    if name in ("listen", "advertise") and value:
        parse_hostport(value, flag)
    if name == "peers":
        for peer in value:
            parse_hostport(peer, flag)
    if name in ("task_option", "aggregator_option"):
        for kv in value:
            if "=" not in kv:
                raise ConfigError(f"{flag}: '{kv}' is not KEY=VALUE")
    if name in ("swarm_id", "node_id") and (len(value) > 128 or any(c.isspace() for c in value)):
        raise ConfigError(f"{flag}: '{value}' must be at most 128 characters without spaces")


def check_data_dir(path: str) -> Path:
    """Create the data dir if needed and make sure we can write there."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"--data-dir: cannot write to '{path}' ({reason}); choose a folder you own"
        ) from None
    return p

"""Built-in task ``bytelm``: a small byte-level GPT trained on Python's own standard library.

Nothing is downloaded: the corpus is the ``*.py`` source of the running interpreter's stdlib.
Nodes on different Python versions therefore read (slightly) different text; the corpus
``digest`` is logged so a mismatch is visible. Options (``--task-option k=v``):

- ``corpus_mb``: how much source to read, default 8 (about 1 s of startup at most)
- ``val_windows``: number of fixed validation windows, default 16
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import sysconfig
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neuronode.training.task import Task, TaskConfig, TaskError, next_token_objective, task_device

logger = logging.getLogger(__name__)

DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024
DEFAULT_VAL_WINDOWS = 16
_VAL_SEED = 0x5EED  # the validation windows are the same on every node
_FILE_SEPARATOR = b"\0"
# Pruned while walking: site-packages alone can hold tens of thousands of files.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}
)


# --- model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 128  # longest sequence the position embedding covers
    vocab_size: int = 256  # bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.size()
        assert T <= self.cfg.block_size, f"sequence of {T} > block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 init drawn only from ``generator``, in parameter order: the same on every node."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled: these add into the residual stream
                p.normal_(0.0, residual_std, generator=generator)
            elif p.dim() >= 2:  # embeddings and linear weights
                p.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("weight"):  # LayerNorm gain
                p.fill_(1.0)
            else:  # biases
                p.zero_()


def build_model(cfg: GPTConfig, *, seed: int) -> GPT:
    """Bit-identical weights for a given seed, without touching the global RNG's state."""
    # nn.Linear & co. draw a default init from the global RNG; fork it so callers' streams
    # stay unchanged, then overwrite every weight from a local generator.
    with torch.random.fork_rng(devices=[]):
        model = GPT(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


# --- corpus ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteCorpus:
    train: Tensor  # (N_train,) uint8, files joined with a NUL byte
    val: Tensor  # (N_val,) uint8
    train_files: tuple[str, ...]  # stdlib-relative posix paths
    val_files: tuple[str, ...]
    digest: str  # sha256 prefix over train+val; equal on nodes that read the same text


def is_val_file(rel_path: str) -> bool:
    """Split by file, not by offset, so no source file leaks into both sets."""
    return zlib.crc32(rel_path.encode()) % 10 == 0


def stdlib_files(root: Path) -> list[str]:
    """All ``*.py`` under ``root`` (minus tests and site-packages), sorted posix paths."""
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(rel_paths)


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | None = None) -> ByteCorpus:
    """Read sorted stdlib files until ``max_bytes``; cached per process. Do not mutate."""
    t0 = time.perf_counter()
    root_path = Path(root or sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    total = 0
    for rel in stdlib_files(root_path):
        if total >= max_bytes:
            break
        try:
            data = (root_path / rel).read_bytes()
        except OSError as e:
            raise TaskError(f"bytelm: cannot read stdlib source {root_path / rel}: {e}") from e
        side = is_val_file(rel)
        parts[side] += [data, _FILE_SEPARATOR]
        names[side].append(rel)
        total += len(data) + 1
    if not names[False] or not names[True]:
        raise TaskError(f"bytelm: no Python sources found under {root_path}; use a plug-in task")
    train_bytes, val_bytes = b"".join(parts[False]), b"".join(parts[True])
    corpus = ByteCorpus(
        train=torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        train_files=tuple(names[False]),
        val_files=tuple(names[True]),
        digest=hashlib.sha256(train_bytes + val_bytes).hexdigest()[:16],
    )
    logger.info(
        "bytelm corpus: %d train / %d val files, %d / %d bytes, digest %s, %.2f s",
        len(corpus.train_files),
        len(corpus.val_files),
        corpus.train.numel(),
        corpus.val.numel(),
        corpus.digest,
        time.perf_counter() - t0,
    )
    return corpus


# --- batches -----------------------------------------------------------------------------


class ByteBatches:
    """Endless random windows ``(x, y)``, each ``(B, T)`` long, ``y`` shifted by one byte.

    The stream is a pure function of ``seed`` (the node's data seed). ``state_dict()`` holds
    the generator state and the number of batches drawn; ``load_state_dict()`` of it resumes
    the same stream exactly where it was saved. The daemon checkpoints it.
    """

    def __init__(
        self, data: Tensor, *, batch_size: int, seq_len: int, seed: int, device: torch.device
    ) -> None:
        if data.numel() <= seq_len:
            raise TaskError(f"bytelm: seq_len {seq_len} is longer than the corpus")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.device = device
        self.batches_drawn = 0
        self._generator = torch.Generator().manual_seed(seed)  # CPU: same stream on any device
        self._offsets = torch.arange(seq_len + 1)

    def __iter__(self) -> ByteBatches:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        high = self.data.numel() - self.seq_len  # last start leaves room for T+1 bytes
        starts = torch.randint(high, (self.batch_size,), generator=self._generator)  # (B,)
        window = self.data[starts[:, None] + self._offsets]  # (B, T+1) uint8
        window = window.to(self.device, non_blocking=True).long()  # copy bytes, widen there
        self.batches_drawn += 1
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # x, y: (B, T)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # .cpu(): a checkpoint loaded with map_location="cuda" would move the state there.
        self._generator.set_state(state["generator"].cpu())
        self.batches_drawn = int(state["batches_drawn"])


def validation_windows(data: Tensor, *, n_windows: int, seq_len: int) -> Tensor:
    """Fixed windows ``(W, T+1)`` long, drawn with a constant seed: the same on every node."""
    if data.numel() <= seq_len:
        raise TaskError(f"bytelm: seq_len {seq_len} is longer than the validation text")
    generator = torch.Generator().manual_seed(_VAL_SEED)
    starts = torch.randint(data.numel() - seq_len, (n_windows,), generator=generator)  # (W,)
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()  # (W, T+1)


# --- task --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    val_windows: int = DEFAULT_VAL_WINDOWS


def _parse_options(options: Mapping[str, str]) -> _Options:
    known = {"corpus_mb", "val_windows"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TaskError(
            f"bytelm: unknown --task-option {', '.join(unknown)}; known: corpus_mb, val_windows"
        )
    try:
        corpus_mb = float(options.get("corpus_mb", DEFAULT_CORPUS_BYTES / 2**20))
        val_windows = int(options.get("val_windows", DEFAULT_VAL_WINDOWS))
    except ValueError as e:
        raise TaskError(f"bytelm: bad --task-option value: {e}") from e
    if not corpus_mb > 0 or val_windows < 1:
        raise TaskError("bytelm: --task-option corpus_mb must be > 0 and val_windows >= 1")
    return _Options(corpus_bytes=int(corpus_mb * 2**20), val_windows=val_windows)


def factory(cfg: TaskConfig) -> Task:
    """The ``bytelm`` task: byte-level GPT on stdlib source, sized by ``cfg``."""
    opts = _parse_options(cfg.options)
    device = task_device(cfg.device)
    corpus = load_corpus(opts.corpus_bytes)
    gpt_cfg = GPTConfig(
        block_size=cfg.seq_len, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_embd=cfg.d_model
    )
    model = build_model(gpt_cfg, seed=cfg.seed).to(device)
    batches = ByteBatches(
        corpus.train,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        seed=cfg.data_seed,
        device=device,
    )
    val = validation_windows(corpus.val, n_windows=opts.val_windows, seq_len=cfg.seq_len)
    val = val.to(device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    loss_fn, validate = next_token_objective(lambda model, x: model(x), val, bf16=bf16)

    return Task(
        model=model,
        batches=batches,
        loss_fn=loss_fn,
        validate=validate,
        samples_per_batch=cfg.batch_size,
        tokens_per_batch=cfg.batch_size * cfg.seq_len,
        # --n-heads changes no parameter shape: without it here, nodes would average apart.
        settings={"--seq-len": str(cfg.seq_len), "--d-model": str(cfg.d_model),
                  "--n-layers": str(cfg.n_layers), "--n-heads": str(cfg.n_heads)},
        files={"config.json": (json.dumps({"neuronode_task": "bytelm", **dataclasses.asdict(gpt_cfg)},
                                          indent=2) + "\n").encode()},
    )


def load_exported(model_dir: str | Path) -> GPT:
    """The model `neuronode export` wrote for this task (config.json and model.safetensors, no
    hf extra needed): ``model = load_exported("out"); logits = model(byte_ids)``."""
    from safetensors.torch import load_file

    folder = Path(model_dir)
    fields = json.loads((folder / "config.json").read_text())
    fields.pop("neuronode_task", None)
    model = build_model(GPTConfig(**fields), seed=0)
    tensors = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to wte
        raise ValueError(f"{folder}: not a bytelm export (missing {missing}, unexpected {unexpected})")
    return model.eval()

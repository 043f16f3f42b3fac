"""Task ``hf``: a causal LM of any architecture transformers knows, on local text.

Options (``--task-option k=v,...``; docs/models.md has the walk-through):

- ``model=DIR``: a directory with the ``config.json`` of a causal LM. Initial weights: the
  directory's ``model.safetensors`` (or sharded safetensors) when present, else transformers'
  own initialisation drawn under the swarm seed (bit-identical on every node).
- ``tokenizer=DIR`` (a directory AutoTokenizer loads) or ``tokenizer=bytes`` (256 byte tokens).
- ``data=GLOB`` of .txt / .jsonl / .parquet shards, a folder of them, or ``data=@FILE`` listing
  paths or globs one a line (for a path with a comma, which --task-option splits on; ``--data``
  takes one whole); ``text_field=`` (default text).
- ``val_data=GLOB`` (or a folder, or ``@FILE``), or ``val_share=F`` (default 0.01): a share of the
  documents, chosen by a hash of their text, held out on every node alike, and at least enough of
  them for one validation window (neuronode.training.holdout); ``val_windows=N`` (default 16).

``--model``, ``--tokenizer``, ``--data`` and ``--val-data`` are these options as flags.
- ``gradient_checkpointing=true``; ``shuffle_docs=N`` (shuffle buffer, default 1024 documents).

Nothing is ever downloaded: the Hugging Face libraries run in offline mode.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from neuronode.training.holdout import validation_split
from neuronode.training.task import Task, TaskConfig, TaskError, next_token_objective, task_device
from neuronode.training.textdata import (
    Corpus,
    TokenStream,
    expand_shards,
    require,
    validation_documents,
    validation_windows,
)
from neuronode.training.tokenizer import (
    encoder,
    load_tokenizer,
    special_ids,
    tokenizer_files,
    tokenizer_hash,
)

logger = logging.getLogger(__name__)

# The main sizes of a config, by the names transformers gives them on every architecture (GPT-2's
# n_embd reads as hidden_size through its attribute map): compared at Hello one by one, so a
# refusal names the size that differs rather than a hash.
SIZES = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "vocab_size", "max_position_embeddings")
# What a config may say that does not change the model a swarm trains.
_NOT_ARCHITECTURE = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
                     "architectures", "output_attentions", "output_hidden_states"}
KNOWN_OPTIONS = ("model", "tokenizer", "data", "text_field", "val_data", "val_share", "val_windows",
                 "gradient_checkpointing", "shuffle_docs")


@dataclass(frozen=True)
class Options:
    model: str
    tokenizer: str
    data: str
    text_field: str = "text"
    val_data: str = ""
    val_share: float = 0.01
    val_windows: int = 16
    gradient_checkpointing: bool = False
    shuffle_docs: int = 1024


def parse_options(options: Mapping[str, str]) -> Options:
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise TaskError(f"hf: unknown --task-option {', '.join(unknown)}; known: {', '.join(KNOWN_OPTIONS)}")
    missing = [k for k in ("model", "tokenizer", "data") if not options.get(k)]
    if missing:
        raise TaskError(f"hf: give --task-option {','.join(f'{k}=...' for k in missing)} "
                        "(model=DIR,tokenizer=DIR|bytes,data=GLOB)")
    if "val_data" in options and "val_share" in options:
        raise TaskError("hf: give val_data=GLOB or val_share=F, not both")
    flag = options.get("gradient_checkpointing", "false").lower()
    if flag not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise TaskError(f"hf: gradient_checkpointing={flag} is not true or false")
    try:
        opts = Options(model=options["model"], tokenizer=options["tokenizer"], data=options["data"],
                       text_field=options.get("text_field", "text"), val_data=options.get("val_data", ""),
                       val_share=float(options.get("val_share", 0.01)),
                       val_windows=int(options.get("val_windows", 16)),
                       gradient_checkpointing=flag in ("true", "1", "yes", "on"),
                       shuffle_docs=int(options.get("shuffle_docs", 1024)))
    except ValueError as exc:
        raise TaskError(f"hf: bad --task-option value: {exc}") from None
    if not 0 <= opts.val_share < 1 or opts.val_windows < 1 or opts.shuffle_docs < 1:
        raise TaskError("hf: val_share must be in [0, 1), val_windows and shuffle_docs at least 1")
    if not opts.val_data and opts.val_share == 0:
        raise TaskError("hf: val_share=0 holds nothing out; give val_data=GLOB for validation")
    return opts


def load_config(model_dir: str) -> Any:
    transformers = require("transformers", "--task hf")
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise TaskError(f"model={model_dir}: no config.json there (a directory with a causal LM's config.json)")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - one line naming the file
        raise TaskError(f"model={model_dir}: transformers cannot read config.json: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from None


def has_weights(model_dir: str) -> bool:
    path = Path(model_dir).expanduser()
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def build_model(config: Any, *, model_dir: str, seed: int) -> nn.Module:
    """The model on the CPU in float32: the directory's safetensors weights, or transformers'
    initialisation drawn from ``seed`` alone (the global RNG forked, so callers' streams stay)."""
    transformers = require("transformers", "--task hf")
    auto = transformers.AutoModelForCausalLM
    try:
        if has_weights(model_dir):
            model = auto.from_pretrained(str(Path(model_dir).expanduser()), config=config, local_files_only=True)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = auto.from_config(config)
    except ValueError as exc:
        raise TaskError(f"model={model_dir}: not a causal LM transformers can build: {str(exc)[:300]}") from None
    except OSError as exc:
        raise TaskError(f"model={model_dir}: cannot load its weights: {str(exc)[:300]}") from None
    return model.float()


def architecture_hash(config: Any) -> str:
    """sha256 prefix of the config, less what does not change the model (version, dtype)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_ARCHITECTURE}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_digest(model: nn.Module) -> str:
    """sha256 prefix of the initial parameters (float32, in order): nodes that would start from
    different weights (another safetensors file, another transformers init) are refused."""
    hasher = hashlib.sha256()
    with torch.no_grad():
        for p in model.parameters():
            hasher.update(np.ascontiguousarray(p.detach().cpu().numpy(), dtype="<f4").data)
    return hasher.hexdigest()[:16]


def settings(config: Any, *, seq_len: int, tok_hash: str, init: str) -> dict[str, str]:
    """What every node must run alike (compared at Hello, in this order, named when they differ)."""
    out = {"--seq-len": str(seq_len)}
    for name in SIZES:
        value = getattr(config, name, None)
        if value is not None:
            out[name] = str(value)
    out["architecture"] = architecture_hash(config)
    out["tokenizer"] = tok_hash
    out["initial weights"] = init
    return out


def export_files(config: Any, tok: Any) -> dict[str, bytes]:
    """config.json, generation_config.json and the tokenizer's files, as exported: the swarm's
    config with weights in float32 and the special token ids of the tokenizer the swarm trained
    with (not the architecture's defaults: Llama's say eos 2, which a trained tokenizer gives to
    some other token, and generate() would never stop at the end of a text)."""
    transformers = require("transformers", "--task hf")
    ids = special_ids(tok)
    data = {**config.to_dict(), **ids, "dtype": "float32"}
    data.pop("torch_dtype", None)
    generation = transformers.GenerationConfig(**{k: v for k, v in ids.items() if v is not None})
    return {"config.json": (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(),
            "generation_config.json": generation.to_json_string(use_diff=True).encode(),
            **tokenizer_files(tok)}


def logits(model: nn.Module, x: Tensor) -> Tensor:
    """A Hugging Face causal LM's next-token logits for the token ids `x` (B, T, vocab)."""
    return model(input_ids=x, use_cache=False).logits


def validation(opts: Options, shards: list[str], *, encode: Any, eos_id: int | None,
               seq_len: int) -> tuple[int, Tensor]:
    """(hash bound of the documents held out of training, validation windows): from val_data
    (nothing held out), or from the held-out share of the training shards."""
    if opts.val_data:
        documents = validation_documents(expand_shards(opts.val_data, option="val_data"),
                                         text_field=opts.text_field, below=None)
        return 0, validation_windows(documents, encode=encode, eos_id=eos_id, seq_len=seq_len,
                                     n_windows=opts.val_windows)
    return validation_split(shards, text_field=opts.text_field, share=opts.val_share, encode=encode,
                            eos_id=eos_id, seq_len=seq_len, n_windows=opts.val_windows)


def factory(cfg: TaskConfig) -> Task:
    """The ``hf`` task."""
    opts = parse_options(cfg.options)
    config = load_config(opts.model)
    tok = load_tokenizer(opts.tokenizer)
    vocab = len(tok)
    if config.vocab_size < vocab:
        raise TaskError(f"model={opts.model}: config.json has vocab_size {config.vocab_size}, smaller than the "
                        f"tokenizer's {vocab} tokens; set vocab_size to at least {vocab}")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        raise TaskError(f"--seq-len {cfg.seq_len} is longer than the model's max_position_embeddings {max_pos}")
    shards = expand_shards(opts.data, option="data")
    device = task_device(cfg.device)
    model = build_model(config, model_dir=opts.model, seed=cfg.seed)
    init = weights_digest(model)
    if opts.gradient_checkpointing:
        enable: Any = model.gradient_checkpointing_enable  # a transformers PreTrainedModel's
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.to(device)
    encode = encoder(tok)
    eos = tok.eos_token_id
    below, val = validation(opts, shards, encode=encode, eos_id=eos, seq_len=cfg.seq_len)
    val = val.to(device)
    corpus = Corpus(shards=tuple(shards), text_field=opts.text_field, holdout_below=below)
    batches = TokenStream(corpus, encode=encode, eos_id=eos, batch_size=cfg.batch_size,
                          seq_len=cfg.seq_len, seed=cfg.data_seed, device=device, shuffle_docs=opts.shuffle_docs)
    batches.state_dict()  # reads the first documents now: an empty or unreadable corpus stops the start
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    logger.info("hf task: %s, %d parameters, %s initial weights, tokenizer of %d tokens, %d shard(s), %d validation windows",
                config.model_type, sum(p.numel() for p in model.parameters()),
                "pretrained" if has_weights(opts.model) else "seeded", vocab, len(shards), val.size(0))

    loss_fn, validate = next_token_objective(logits, val, bf16=bf16, batch_size=cfg.batch_size)

    return Task(model=model, batches=batches, loss_fn=loss_fn, validate=validate,
                samples_per_batch=cfg.batch_size, tokens_per_batch=cfg.batch_size * cfg.seq_len,
                settings=settings(config, seq_len=cfg.seq_len, tok_hash=tokenizer_hash(tok), init=init),
                files=export_files(config, tok))

"""Tokenizers for the ``hf`` task: loading one, the 256-token byte tokenizer, training a
byte-level BPE tokenizer on local text (``neuronode tokenizer train``), and the tokenizer's hash
(what the swarm's settings compare)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from neuronode.training.task import TaskError
from neuronode.training.textdata import expand_shards, read_documents, require

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
BYTE_EOS = 0  # tokenizer=bytes: documents end with a NUL byte, as in the built-in task


def _byte_level_tokenizer(model: Any) -> Any:
    """A tokenizers.Tokenizer with byte-level pre-tokenizing and decoding around `model`."""
    tokenizers = require("tokenizers", "a byte-level tokenizer")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def bytes_tokenizer() -> Any:
    """``tokenizer=bytes``: token i is byte i (256 tokens, no merges), as a transformers fast
    tokenizer, so it is exported as a tokenizer.json that AutoTokenizer loads. Its end-of-text
    token is byte 0."""
    tokenizers = require("tokenizers", "tokenizer=bytes")
    transformers = require("transformers", "tokenizer=bytes")
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; order the vocabulary by byte value.
    chars = {_byte_char(b): b for b in range(256)}
    assert set(chars) == set(alphabet)
    model = tokenizers.models.BPE(vocab=chars, merges=[])
    tok = _byte_level_tokenizer(model)
    eos = _byte_char(BYTE_EOS)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, model_max_length=1 << 30)


def _byte_char(b: int) -> str:
    """The character GPT-2's byte-level alphabet uses for byte ``b``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def load_tokenizer(spec: str) -> Any:
    """``tokenizer=DIR`` (a directory transformers loads, local files only) or ``bytes``."""
    if spec == "bytes":
        return bytes_tokenizer()
    transformers = require("transformers", "tokenizer=DIR")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise TaskError(f"tokenizer={spec}: no such directory (give a tokenizer directory, or 'bytes')")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, one line naming the directory
        raise TaskError(f"tokenizer={spec}: transformers cannot load it: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from None
    if not getattr(tok, "is_fast", False):
        raise TaskError(f"tokenizer={spec}: only fast tokenizers (a tokenizer.json) are supported")
    return tok


def encoder(tok: Any) -> Any:
    """text -> token ids, without special tokens (the stream adds end-of-text itself)."""
    backend = tok.backend_tokenizer

    def encode(text: str) -> list[int]:
        return list(backend.encode(text, add_special_tokens=False).ids)

    return encode


def tokenizer_hash(tok: Any) -> str:
    """sha256 prefix of the vocabulary, the merges and the added tokens: equal for tokenizers
    that split text into the same ids."""
    model = json.loads(tok.backend_tokenizer.to_str()).get("model", {})
    added = sorted((t.content, i) for i, t in tok.added_tokens_decoder.items())
    canonical = json.dumps({"type": model.get("type"), "vocab": model.get("vocab"), "merges": model.get("merges"),
                            "added": added}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# What from_pretrained records about how it was called, which save_pretrained writes back: not
# part of the tokenizer (an exported tokenizer_config.json saying local_files_only binds its users).
LOAD_KEYS = frozenset({"local_files_only", "is_local", "cache_dir", "force_download", "proxies", "token",
                       "use_auth_token", "revision", "subfolder", "_commit_hash", "trust_remote_code"})


def special_ids(tok: Any) -> dict[str, int | None]:
    """bos, eos and pad token ids as an exported model's config says them: the tokenizer's own;
    a tokenizer without a pad token pads with end-of-text (what generate() and batching need)."""
    eos = tok.eos_token_id
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": eos,
            "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else eos}


def tokenizer_files(tok: Any) -> dict[str, bytes]:
    """The files save_pretrained writes (tokenizer.json, tokenizer_config.json, ...), by name, as
    exported: without the keys of how it was loaded, with end-of-text as the pad token when the
    tokenizer has none."""
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    if "tokenizer_config.json" in files:
        config = {k: v for k, v in json.loads(files["tokenizer_config.json"]).items() if k not in LOAD_KEYS}
        if config.get("pad_token") is None and tok.eos_token is not None:
            config["pad_token"] = tok.eos_token
        files["tokenizer_config.json"] = (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False)
                                          + "\n").encode()
    return files


def use_threads(threads: int) -> None:
    """Bound the threads of tokenizers' and Arrow's pools to `threads` (0: every core). Before
    either library made its pool: rayon reads RAYON_RS_NUM_CPUS once, when it first runs."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    if threads:
        os.environ["RAYON_RS_NUM_CPUS"] = str(threads)
        try:
            import pyarrow
        except ImportError:
            return
        pyarrow.set_cpu_count(threads)
        pyarrow.set_io_thread_count(threads)


def train_tokenizer(data: str, *, vocab_size: int, out: str, text_field: str = "text",
                    threads: int = 0) -> dict[str, Any]:
    """``neuronode tokenizer train``: a byte-level BPE tokenizer of ``vocab_size`` tokens (one of
    them ``<|endoftext|>``) trained on the documents of the ``data`` glob (a folder, a glob or
    @FILE) with ``threads`` threads (0: every core); saved to ``out`` as a directory
    AutoTokenizer loads. Returns a summary for the CLI."""
    if vocab_size < 257:
        raise TaskError(f"--vocab {vocab_size}: a byte-level BPE tokenizer needs at least 257 tokens "
                        "(256 bytes and end-of-text)")
    use_threads(threads)
    tokenizers = require("tokenizers", "neuronode tokenizer train")
    transformers = require("transformers", "neuronode tokenizer train")
    shards = expand_shards(data, option="--data")
    t0 = time.perf_counter()
    count = [0]

    def texts() -> Any:
        for path in shards:
            for text in read_documents(path, text_field=text_field):
                count[0] += 1
                yield text

    tok = _byte_level_tokenizer(tokenizers.models.BPE())
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT,
                                                bos_token=END_OF_TEXT, unk_token=None, model_max_length=1 << 30)
    out_dir = Path(out).expanduser()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    except OSError as exc:
        raise TaskError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
    return {"out": str(out_dir), "vocab": len(fast), "documents": count[0], "shards": len(shards),
            "threads": threads, "tokenizer_hash": tokenizer_hash(fast), "seconds": round(time.perf_counter() - t0, 3)}

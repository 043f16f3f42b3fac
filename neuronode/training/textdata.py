"""Local text corpora for the ``hf`` task: shards of ``.txt``, ``.jsonl`` or ``.parquet`` read
with ``datasets`` in streaming mode, shuffled per node, tokenized and packed into windows.

The stream a node trains on is a pure function of (shards, seed, position):

- a *pass* visits every training document once. Its shard order is a permutation drawn from
  (seed, pass); inside a shard the documents go through a shuffle buffer seeded by
  (seed, pass, shard), emptied at the end of each shard.
- documents are tokenized, each followed by the end-of-text token (if the tokenizer has one),
  and concatenated; window ``w`` is tokens ``[w*T, w*T + T + 1)`` of that sequence (inputs and
  targets shifted by one), so every token is a target once.
- the *position* is (pass, shard index in the pass, document index in the shard's shuffled
  order, token offset in that document): ``state_dict()`` saves it, ``load_state_dict()`` reads
  the shard again up to there (reading only, no tokenizing) and continues exactly where the
  saved stream was. No document already trained on in the pass comes again before it ends.

Nothing here knows about nodes or ranks: a caller that wants several streams (one per node, or
one per rank of a member) builds one :class:`TokenStream` per data seed and keeps each state.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from neuronode.training.task import TaskError

logger = logging.getLogger(__name__)

# Hugging Face libraries read these at import: set before any of them is imported, so nothing
# is ever downloaded (a hub name given where a local path belongs fails instead of fetching).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
STATE_VERSION = 1
DEFAULT_SHUFFLE_DOCS = 1024
HF_EXTRA = "pip install '.[hf]' in a clone of neuronode (not 'neuronode' from PyPI, another project)"


def go_offline() -> None:
    """Set the offline switches (before transformers, tokenizers or datasets is imported)."""
    for key, value in OFFLINE_ENV.items():
        os.environ[key] = value
    # A node tokenizes one document at a time beside its training threads: no pool of tokenizers'
    # own, unless set before (`neuronode tokenizer train --threads`).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def require(module: str, what: str) -> Any:
    """Import an optional module of the hf extra, or stop with one line saying what to install."""
    go_offline()
    try:
        return __import__(module)
    except ImportError as exc:
        raise TaskError(f"{what} needs the hf extra ({module} is not installed): {HF_EXTRA}") from exc


def expand_shards(spec: str, *, option: str) -> list[str]:
    """Shard files named by a glob (``data=corpus/*.jsonl``), a folder (its .txt, .jsonl, .json
    and .parquet files, in subfolders too; hidden ones left out) or, with ``@FILE``, by a file
    that lists any of these one a line (relative to that file; how to pass a path with a comma,
    which --task-option would split). Sorted, each checked readable; one line naming what is
    wrong."""
    if spec.startswith("@"):
        listing = Path(spec[1:])
        try:
            lines = listing.read_text().splitlines()
        except OSError as exc:
            raise TaskError(f"{option}={spec}: cannot read the shard list {listing}: {exc.strerror or exc}") from None
        patterns = [str(listing.parent / line.strip()) for line in lines if line.strip() and not line.startswith("#")]
    else:
        patterns = [spec]
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(os.path.expanduser(pattern)):
            files += shards_in(os.path.expanduser(pattern), option=option)
            continue
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise TaskError(f"{option}: no file matches {pattern}")
        files += [m for m in matched if not os.path.isdir(m)]
    for path in files:
        if Path(path).suffix.lower() not in BUILDERS:
            raise TaskError(f"{option}: {path} is not .txt, .jsonl, .json or .parquet")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise TaskError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    if not files:
        raise TaskError(f"{option}: {spec} names no file")
    return sorted(dict.fromkeys(files))


def shards_in(folder: str, *, option: str) -> list[str]:
    """The shard files under `folder` (any depth), by suffix; others (a README, an index) are
    not text to train on and are left out."""
    found = sorted(str(p) for p in Path(folder).rglob("*") if p.suffix.lower() in BUILDERS and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not found:
        raise TaskError(f"{option}: the folder {folder} holds no .txt, .jsonl, .json or .parquet file")
    return found


def read_documents(path: str, *, text_field: str = "text") -> Iterator[str]:
    """The documents of one shard in file order, streamed by ``datasets`` (never all in memory):
    a ``.txt`` file's paragraphs (blank-line separated), a ``.jsonl``/``.parquet`` file's
    ``text_field`` column. Empty documents are left out."""
    datasets = require("datasets", "reading data shards")
    builder = BUILDERS[Path(path).suffix.lower()]
    kwargs: dict[str, Any] = {}
    if builder == "text":
        kwargs["sample_by"] = "paragraph"
    elif builder == "parquet":
        kwargs["columns"] = [text_field]
    try:
        rows = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True, **kwargs)
        for row in rows:
            text = row.get("text" if builder == "text" else text_field)
            if text is None:
                raise TaskError(f"text_field: {path} has no column '{text_field}' (columns: {', '.join(row)})")
            if not isinstance(text, str):
                raise TaskError(f"text_field: column '{text_field}' of {path} holds {type(text).__name__}, not text")
            if text:
                yield text
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken shard is named, whatever the reader raised
        raise TaskError(f"cannot read {path}: {type(exc).__name__}: {str(exc)[:300]}") from None


def doc_hash(text: str) -> int:
    """A document's place in the hold-out order: a 64-bit hash of its text, so every node holds
    out the same documents whatever the order it reads them in."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def share_below(share: float) -> int:
    """The hash bound of a share: documents hashing below it are that share of a corpus."""
    return math.ceil(share * 2**64) if share > 0 else 0


def held_out(text: str, share: float) -> bool:
    """Whether a document belongs to the validation share."""
    return doc_hash(text) < share_below(share)


@dataclass(frozen=True)
class Corpus:
    """Where a stream's documents come from and which of them it skips."""

    shards: tuple[str, ...]
    text_field: str = "text"
    holdout_below: int = 0  # documents hashing below this are held out for validation, never trained on

    def documents(self, path: str) -> Iterator[str]:
        for text in read_documents(path, text_field=self.text_field):
            if doc_hash(text) >= self.holdout_below:
                yield text


@dataclass(frozen=True)
class Position:
    """Where a stream stands: the next token is ``offset`` in document ``doc`` of the shard at
    ``shard`` in pass ``pass_index``'s shard order."""

    pass_index: int = 0
    shard: int = 0
    doc: int = 0
    offset: int = 0


class TokenStream:
    """Endless batches ``(x, y)`` of ``(B, T)`` token ids from a corpus; a StatefulIterator.

    ``documents`` counts the documents of the current pass begun so far (``progress``)."""

    def __init__(self, corpus: Corpus, *, encode: Callable[[str], list[int]], eos_id: int | None,
                 batch_size: int, seq_len: int, seed: int, device: torch.device | str = "cpu",
                 shuffle_docs: int = DEFAULT_SHUFFLE_DOCS) -> None:
        self.corpus = corpus
        self.encode = encode
        self.eos_id = eos_id
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = torch.device(device)
        self.shuffle_docs = shuffle_docs
        self.windows = 0
        self._start(Position())

    # ---- document order ------------------------------------------------------------------

    def shard_order(self, pass_index: int) -> list[int]:
        rng = random.Random(f"shards/{self.seed}/{pass_index}")
        order = list(range(len(self.corpus.shards)))
        rng.shuffle(order)
        return order

    def shuffled(self, pass_index: int, shard_index: int) -> Iterator[str]:
        """One shard's documents through a seeded shuffle buffer, emptied at the shard's end."""
        rng = random.Random(f"docs/{self.seed}/{pass_index}/{shard_index}")
        buffer: list[str] = []
        for text in self.corpus.documents(self.corpus.shards[shard_index]):
            if len(buffer) < self.shuffle_docs:
                buffer.append(text)
                continue
            j = rng.randrange(len(buffer))
            buffer[j], text = text, buffer[j]
            yield text
        rng.shuffle(buffer)
        yield from buffer

    def _documents_from(self, pos: Position) -> Iterator[tuple[Position, str]]:
        """Documents from ``pos`` on (offset aside), with their positions; endless."""
        pass_index, shard, skip = pos.pass_index, pos.shard, pos.doc
        while True:
            order = self.shard_order(pass_index)
            found = False
            for k in range(shard, len(order)):
                for doc, text in enumerate(self.shuffled(pass_index, order[k])):
                    found = True
                    if doc >= skip:
                        yield Position(pass_index, k, doc), text
                skip = 0
            if not found and shard == 0:
                raise TaskError(f"data: no training documents in {len(self.corpus.shards)} shard(s) "
                                "(all empty or held out for validation)")
            pass_index, shard = pass_index + 1, 0
            logger.info("data pass %d begins", pass_index)

    def _start(self, pos: Position) -> None:
        self._docs = self._documents_from(pos)
        # Tokenized documents from the cursor's on: the first holds the next token at _offset.
        self._queue: list[tuple[Position, list[int]]] = []
        self._offset = pos.offset
        self.documents = 0
        self._counted: tuple[int, int, int] | None = None  # the last document counted in `documents`

    def _pull(self) -> None:
        pos, text = next(self._docs)
        tokens = self.encode(text)
        if self.eos_id is not None:
            tokens.append(self.eos_id)
        self._queue.append((pos, tokens))

    # ---- iteration -------------------------------------------------------------------------

    def __iter__(self) -> TokenStream:
        return self

    def window(self) -> list[int]:
        """The next T+1 tokens; advances the cursor by T."""
        need = self.seq_len + 1
        out: list[int] = []
        i, offset = 0, self._offset
        while len(out) < need:
            while i >= len(self._queue):
                self._pull()
            tokens = self._queue[i][1]
            part = tokens[offset:offset + need - len(out)]
            out += part
            if offset + len(part) >= len(tokens):
                i, offset = i + 1, 0
            else:
                offset += len(part)
        self._advance(self.seq_len)
        self.windows += 1
        return out

    def _advance(self, n_tokens: int) -> None:
        while n_tokens:
            pos, tokens = self._queue[0]
            self._note(pos)
            left = len(tokens) - self._offset
            if left > n_tokens:
                self._offset += n_tokens
                return
            n_tokens -= left
            self._queue.pop(0)
            self._offset = 0
            if not self._queue:
                self._pull()  # the cursor always names a document

    def _note(self, pos: Position) -> None:
        """Count a document of this pass once, when its first input token is taken."""
        key = (pos.pass_index, pos.shard, pos.doc)
        if key != self._counted:
            if self._counted is not None and pos.pass_index != self._counted[0]:
                self.documents = 0
            self._counted = key
            self.documents += 1

    def __next__(self) -> tuple[Tensor, Tensor]:
        rows = torch.tensor([self.window() for _ in range(self.batch_size)], dtype=torch.long)  # (B, T+1)
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # x, y: (B, T)

    # ---- position --------------------------------------------------------------------------

    @property
    def position(self) -> Position:
        if not self._queue:
            self._pull()
        pos = self._queue[0][0]
        return Position(pos.pass_index, pos.shard, pos.doc, self._offset)

    @property
    def progress(self) -> dict[str, int]:
        """The current pass and the documents of it begun so far (status fields). Plain reads:
        safe from another thread while this one trains."""
        counted = self._counted
        return {"data_pass": counted[0] if counted else 0, "data_documents": self.documents}

    def state_dict(self) -> dict[str, Any]:
        pos = self.position
        return {"version": STATE_VERSION, "seed": self.seed, "shards": len(self.corpus.shards),
                "pass": pos.pass_index, "shard": pos.shard, "doc": pos.doc, "offset": pos.offset,
                "documents": self.documents, "counted": list(self._counted or ()), "windows": self.windows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise TaskError(f"data stream state version {state.get('version')!r} is not {STATE_VERSION}")
        if int(state["shards"]) != len(self.corpus.shards):
            # Another corpus: the saved position means nothing in it; start a new pass.
            logger.warning("data: the checkpoint's stream had %d shards, now %d; starting a new pass",
                           int(state["shards"]), len(self.corpus.shards))
            self._start(Position(int(state["pass"]) + 1))
            return
        pos = Position(int(state["pass"]), int(state["shard"]), int(state["doc"]), int(state["offset"]))
        self._start(pos)
        self.windows = int(state["windows"])
        self.documents = int(state["documents"])
        counted = [int(v) for v in state.get("counted", ())]
        self._counted = (counted[0], counted[1], counted[2]) if len(counted) == 3 else None


def validation_windows(documents: Iterator[str], *, encode: Callable[[str], list[int]], eos_id: int | None,
                       seq_len: int, n_windows: int) -> Tensor:
    """The first ``n_windows`` windows ``(W, T+1)`` of the validation documents (read in a fixed
    order: the same on every node); fewer if the documents run out, an error if none fits."""
    tokens: list[int] = []
    need = n_windows * seq_len + 1
    for text in documents:
        tokens += encode(text)
        if eos_id is not None:
            tokens.append(eos_id)
        if len(tokens) >= need:
            break
    count = min(n_windows, (len(tokens) - 1) // seq_len)
    if count < 1:
        raise TaskError(f"validation: the validation documents have {len(tokens)} tokens, fewer than "
                        f"--seq-len + 1 ({seq_len + 1}); give more text in val_data")
    rows = [tokens[w * seq_len:w * seq_len + seq_len + 1] for w in range(count)]
    return torch.tensor(rows, dtype=torch.long)


def validation_documents(shards: Sequence[str], *, text_field: str, below: int | None) -> Iterator[str]:
    """Validation documents in file order: every document of ``shards`` (``val_data``), or,
    with ``below``, only those held out of training (hashing below it: ``val_share``)."""
    for path in shards:
        for text in read_documents(path, text_field=text_field):
            if below is None or doc_hash(text) < below:
                yield text

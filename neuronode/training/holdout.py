"""The validation split of the ``hf`` task with ``val_share``: which documents are held out of
training, and the validation windows they make.

The rule is one bound on a hash of each document's text (``textdata.doc_hash``): documents
hashing below it are held out on every node alike, whatever order a node reads them in. The
bound is ``val_share`` of the hash range. On a small corpus that share can hold out too few
tokens for one validation window (about 100 documents and ``val_share=0.02`` hold out none
one time in eight); then the bound rises to the smallest that holds one window: the documents
of smallest hash, as few as give ``--seq-len`` + 1 tokens. Every node computes the same bound
from the same corpus, and the start says so in one line.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence

from torch import Tensor

from neuronode.events import fields
from neuronode.training.task import TaskError
from neuronode.training.textdata import (
    doc_hash,
    read_documents,
    share_below,
    validation_documents,
    validation_windows,
)

logger = logging.getLogger(__name__)


class Smallest:
    """The documents of smallest hash seen so far that hold at least `need` tokens, and no more
    of them than that takes (a max-heap on the hash; the largest leaves while the rest suffice)."""

    def __init__(self, need: int, count: Callable[[str], int]) -> None:
        self.need = need
        self.count = count  # a document's tokens, end-of-text included
        self.heap: list[tuple[int, int]] = []  # (-hash, tokens)
        self.tokens = 0

    def offer(self, h: int, text: str) -> None:
        """A document of hash `h` (tokenized only when it may belong)."""
        if self.tokens >= self.need and h > -self.heap[0][0]:
            return
        n = self.count(text)
        heapq.heappush(self.heap, (-h, n))
        self.tokens += n
        while self.tokens - self.heap[0][1] >= self.need:
            self.tokens -= heapq.heappop(self.heap)[1]

    def bound(self) -> int:
        """The hash bound that holds out exactly these documents."""
        return -self.heap[0][0] + 1


def validation_split(shards: Sequence[str], *, text_field: str, share: float, encode: Callable[[str], list[int]],
                     eos_id: int | None, seq_len: int, n_windows: int) -> tuple[int, Tensor]:
    """(hash bound of the held-out documents, validation windows ``(W, T+1)``). Reads the corpus
    in file order until the held-out documents fill ``n_windows`` windows, or to its end."""
    below, need = share_below(share), seq_len + 1
    eos = [] if eos_id is None else [eos_id]
    smallest = Smallest(need, lambda text: len(encode(text)) + len(eos))
    tokens: list[int] = []
    total = held = 0
    for text in (text for path in shards for text in read_documents(path, text_field=text_field)):
        total += 1
        h = doc_hash(text)
        if h < below:
            held += 1
            tokens += encode(text) + eos
            if len(tokens) >= n_windows * seq_len + 1:
                break
        smallest.offer(h, text)
    if len(tokens) < need:
        below = raised_bound(smallest, total=total, held=held, held_tokens=len(tokens), share=share, seq_len=seq_len)
    documents = validation_documents(shards, text_field=text_field, below=below)
    return below, validation_windows(documents, encode=encode, eos_id=eos_id, seq_len=seq_len, n_windows=n_windows)


def raised_bound(smallest: Smallest, *, total: int, held: int, held_tokens: int, share: float, seq_len: int) -> int:
    """The bound of the fewest documents of smallest hash that fill one window; a TaskError when
    the corpus is too small for a window and a document to train on."""
    if smallest.tokens < seq_len + 1 or len(smallest.heap) >= total:
        raise TaskError(f"validation: the corpus holds {total} document(s), too little for one validation window "
                        f"of --seq-len + 1 ({seq_len + 1}) tokens and text left to train on; add text, lower "
                        "--seq-len, or give val_data=GLOB")
    logger.warning("validation: val_share=%g held out %d of %d documents (%d tokens), fewer than one window of "
                   "--seq-len + 1 (%d) tokens; holding out the %d document(s) of smallest hash instead (%d tokens), "
                   "as every node does", share, held, total, held_tokens, seq_len + 1, len(smallest.heap),
                   smallest.tokens, extra=fields("holdout_raised", val_share=share, held=held, documents=total,
                                                 now_held=len(smallest.heap), tokens=smallest.tokens))
    return smallest.bound()

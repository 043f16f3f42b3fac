"""Error feedback for lossy codecs.

What quantization drops in one round is added back before encoding the next, so the error does
not accumulate in the model: over many rounds the sum of what was sent tracks the sum of the
true pseudo-gradients to within one round's quantization error. With a decay β < 1 (the sparse
codec's --sparse-decay, SparseLoCo's e ← β·e + Δ) what stays unsent fades by β a round.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from neuronode.codec.framing import Assembler
from neuronode.codec.quant import CodecError
from neuronode.memory import empty_floats

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Holds the float32 residual ``compensated - decoded`` of the last round.

    Per round: ``c = ef.compensate(delta)`` (delta + decay × residual); send ``c``;
    ``ef.update(c, roundtrip(c, codec))``.
    """

    def __init__(self, n_elems: int, *, decay: float = 1.0) -> None:
        if n_elems < 0:
            raise CodecError(f"n_elems must be >= 0, got {n_elems}")
        if not 0.0 < decay <= 1.0:
            raise CodecError(f"error-feedback decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.residual = torch.zeros(n_elems, dtype=torch.float32)

    def _check(self, t: torch.Tensor, what: str) -> None:
        if t.shape != self.residual.shape or t.dtype != torch.float32:
            raise CodecError(
                f"{what} must be float32 of shape {tuple(self.residual.shape)}, "
                f"got {t.dtype} {tuple(t.shape)}"
            )

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta + decay × residual`` as a new tensor (delta is left untouched)."""
        self._check(delta, "delta")
        if delta.device.type != "cpu":
            return delta + self.residual.to(delta.device) * self.decay
        if self.decay == 1.0:
            return torch.add(delta, self.residual, out=empty_floats(delta.numel()))
        return torch.add(delta, self.residual, alpha=self.decay, out=empty_floats(delta.numel()))

    def update(self, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Set residual = compensated - decoded (what the wire lost this round)."""
        self._check(compensated, "compensated")
        self._check(decoded, "decoded")
        torch.sub(compensated.detach().cpu(), decoded.detach().cpu(), out=self.residual)

    def update_parts(self, compensated: torch.Tensor, parts: Iterable[tuple[int, Assembler]], *,
                     scale: float = 1.0) -> None:
        """``update(compensated, scale × decoded)`` where ``decoded`` is the concatenation of the
        parts' decoded forms (each Assembler starting at its offset): decoded straight into the
        residual, no contribution-sized temporaries. Same bits as ``update`` at scale 1 (the
        parts encode ``compensated / scale``: a mean over the rounds it carries)."""
        self._check(compensated, "compensated")
        parts = list(parts)
        covered = sum(own.n_elems for _, own in parts)
        if covered != self.residual.numel():
            raise CodecError(f"parts cover {covered} of {self.residual.numel()} elements")
        for start, own in parts:
            own.decode_into(self.residual[start:start + own.n_elems])
        if scale != 1.0:
            self.residual.mul_(scale)
        torch.sub(compensated.detach().cpu(), self.residual, out=self.residual)

    def reset(self) -> None:
        """Forget the residual, e.g. after the node resynchronizes its model from a peer."""
        self.residual.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpointable state (a copy)."""
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from ``state_dict()``; raises CodecError on shape or dtype mismatch."""
        residual = state.get("residual")
        if not isinstance(residual, torch.Tensor):
            raise CodecError("error-feedback state has no 'residual' tensor")
        self._check(residual, "residual")
        self.residual.copy_(residual)

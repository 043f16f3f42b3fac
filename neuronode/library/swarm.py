"""`neuronode.Swarm`: a node of a swarm around your own model, inner optimizer and training loop.

    swarm = neuronode.Swarm(model, optimizer, peers=["203.0.113.5:7420"], swarm_id="my-swarm",
                            secret_file="swarm.secret", inner_steps=500, data_dir="run1")
    for batch in loader:
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        swarm.step(samples=len(batch))   # after inner_steps steps: the round
        if swarm.finished:
            break
    swarm.close()

The node (its gRPC server, the averaging, checkpoints, the status page) runs on a thread and an
event loop of its own. Your loop's thread keeps the model to itself: the node's work on the
model (the pseudo-gradient, the outer step, adopting the swarm's state, checkpoints) runs on
that thread, inside `step()` at a round's end or between two steps (neuronode.node.handoff), so
nothing touches the model while your optimizer steps it. `neuronode start` runs its own
training loop through this same class (neuronode.node.run). docs/library.md has the whole story.
"""

from __future__ import annotations

import asyncio
import atexit
import difflib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from neuronode.config import NodeConfig
from neuronode.config_sources import FIELD_TYPES, build_config
from neuronode.diloco import DiLoCo, OuterConfig
from neuronode.errors import ConfigError, NeuronodeError
from neuronode.node.daemon import Daemon
from neuronode.node.replica import Replica
from neuronode.node.startup import Identity, credentials, identify, run_async

logger = logging.getLogger(__name__)

# NodeConfig fields that configure `neuronode start`'s own model and trainer: a model and an
# optimizer of one's own have their own settings.
TRAINER_ONLY = ("task_option", "seq_len", "d_model", "n_layers", "n_heads", "inner_lr", "weight_decay",
                "warmup_steps", "schedule_steps", "min_lr_ratio", "grad_clip", "seed", "threads", "device",
                "max_restarts", "log_format", "log_level")


class SwarmError(NeuronodeError):
    """The swarm cannot go on as asked: used after close(), or after it finished."""


class Swarm:
    """A member of a swarm training `model` with DiLoCo: your loop steps `inner_optimizer`, the
    swarm averages the rounds.

    Keywords are `neuronode start`'s flags (NodeConfig's fields: ``peers``, ``swarm_id``,
    ``secret_file``, ``inner_steps``, ``codec``, ``data_dir``, ``overlap``, ``rounds``,
    ``metrics_port``, ...), with the same defaults, checks and errors; or pass
    ``config=NodeConfig(...)``. The flags of the built-in model and optimizer (``inner_lr``,
    ``d_model``, ...) are refused: yours have their own.

    - ``validate``: the model's validation loss (it runs in your thread after every outer step
      and at round 0; status and the round history show it).
    - ``settings``: what every member must run alike besides the parameter shapes (a tokenizer,
      a sequence length), by name; a member with another value is refused naming it. Every
      member also declares its initial weights (a digest of the model's parameters as given
      here): a model that starts elsewhere than the swarm's is refused, saying so.
    - ``files``: written next to the weights by ``neuronode export`` (a config.json, a tokenizer).

    The constructor resumes from the newest checkpoint in ``data_dir`` and joins the swarm
    (catching up with it if it is ahead) before it returns. Raises ConfigError (a setting, or
    every bootstrap peer refused us) and StateMismatchError (the optimizer steps other tensors
    than the model's parameters), with the fix in the message.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 validate: Callable[[nn.Module], float] | None = None,
                 settings: Mapping[str, str] | None = None, files: Mapping[str, bytes] | None = None,
                 config: NodeConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"neuronode.Swarm: give config= or keywords, not both ({', '.join(sorted(options))})")
        cfg = config if config is not None else library_config(options)
        lr, momentum = cfg.outer()
        engine = DiLoCo(model, inner_optimizer=inner_optimizer, outer=OuterConfig(lr=lr, momentum=momentum))
        replica = Replica(cfg, engine, task=cfg.task, settings=model_settings(engine, settings),
                          samples_per_batch=cfg.batch_size, validate=validate, files=files)
        self._launch(replica, identity=identify(cfg), stop=None, progress=False)

    @classmethod
    def around(cls, replica: Replica, *, identity: Identity, stop: threading.Event | None, progress: bool,
               launched: Callable[[Swarm], None] = lambda _: None) -> Swarm:
        """The node around a replica built elsewhere: `neuronode start`'s trainer (its task and
        the built-in optimizer), whose loop then steps through `step` as any other.
        `launched` gets the swarm as soon as its node runs (before it joined: a signal handler
        can then ask it to stop)."""
        swarm = cls.__new__(cls)
        swarm._launch(replica, identity=identity, stop=stop, progress=progress, launched=launched)
        return swarm

    def _launch(self, replica: Replica, *, identity: Identity, stop: threading.Event | None, progress: bool,
                launched: Callable[[Swarm], None] = lambda _: None) -> None:
        cfg = replica.cfg
        self._replica, self._cfg = replica, cfg
        self._closed = False
        self._error: BaseException | None = None
        self._raised = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._final_status: dict[str, Any] = {}
        daemon = self._daemon = Daemon(cfg, trainer=replica, node_id=identity.node_id, data_dir=identity.data_dir,
                                       security=credentials(cfg, identity), progress=progress)
        if stop is not None:
            daemon.stop_flag = stop
        self._handoff = daemon.handoff
        daemon.restore()
        self._thread = threading.Thread(target=self._run, name=f"neuronode-node-{identity.node_id[:16]}", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        launched(self)
        try:  # the node starts, resumes, joins and catches up, running its model work on this thread
            self._handoff.wait_turn()
        except BaseException:
            self.close(abandon=True)
            raise
        self._raise_failure()
        replica.resume()

    # ---- the node's thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            run_async(self._main)
        except BaseException as exc:  # handed to the training thread: step() or close() raises it
            self._error = exc
        finally:
            self._handoff.end()

    async def _main(self) -> int:
        self._loop = asyncio.get_running_loop()
        try:
            return await self._daemon.run()
        finally:
            self._final_status = self._status_now()

    def _status_now(self) -> dict[str, Any]:
        swarm = self._daemon.swarm
        return swarm.status() if swarm is not None else self._daemon.status()

    # ---- the training thread's ------------------------------------------------------------

    def step(self, samples: int = 1, *, loss: float | None = None, tokens: int = 0,
             end_round: bool | None = None) -> bool:
        """Count one inner step of your optimizer on `samples` samples (what this member's
        contribution weighs in the average); call it after every ``optimizer.step()``.

        After the round's last step (``inner_steps`` of them, or ``round_seconds`` when set, or
        `end_round=True`) the round runs here: the pseudo-gradient leaves, and the average
        comes back as the outer step, which sets the model's parameters to the swarm's new
        global parameters; with ``overlap=True`` only what must wait does (the previous round's
        outer step), while the exchange runs behind your next round. Returns True when this
        step ended a round. `loss` (a float) and `tokens` feed status, the page and metrics.
        """
        if self._closed:
            raise SwarmError("step() after close(): this swarm member has left; make a new neuronode.Swarm to train on")
        handoff, replica = self._handoff, self._replica
        if handoff.ended:
            self._raise_failure()
            raise SwarmError(f"the swarm is done (it finished its rounds={self._cfg.rounds} rounds, or was "
                             "stopped): end your loop when swarm.finished is true")
        if samples < 0:
            raise ValueError(f"samples must be 0 or more, got {samples}")
        replica.count(samples, loss=loss, tokens=tokens)
        self._daemon.on_step()
        handoff.serve()
        steps, inner_steps = replica.engine.steps_this_round, self._cfg.inner_steps
        if steps < inner_steps and not end_round and not (end_round is None and self._time_up()):
            return False
        replica.ended_early = steps < inner_steps
        handoff.back()
        self._raise_failure()
        replica.resume()
        return True

    def _time_up(self) -> bool:
        seconds = self._cfg.round_seconds
        return bool(seconds) and time.perf_counter() - self._replica.stretch_started >= seconds

    def close(self, *, abandon: bool = False) -> None:
        """Leave the swarm: apply the round still in flight (``overlap``), checkpoint, let our
        last contributions reach the others (up to ``sync_timeout``), stop the node. With
        `abandon` (an interrupted run) the round in flight is dropped and leaving takes a few
        seconds. Call it from your loop's thread; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if abandon:
            self.request_stop()
        try:
            self._handoff.leave()  # the node's last model work (a checkpoint) runs here
        finally:
            self._thread.join()
            atexit.unregister(self._at_exit)
        self._raise_failure()

    def request_stop(self) -> None:
        """Ask the node to stop soon, from any thread (a signal handler): the round in flight
        is abandoned. Your loop then sees `finished`; call close() to leave."""
        self._daemon.stop_flag.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._daemon.request_stop)
            except RuntimeError:  # the loop closed meanwhile: the node is gone already
                pass

    def _at_exit(self) -> None:
        """The interpreter exits while we are open (an exception ended the loop): leave quickly."""
        try:
            self.close(abandon=True)
        except BaseException as exc:  # nobody left to raise it to
            logger.warning("neuronode.Swarm: %s while leaving at exit", exc)

    def _raise_failure(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    # ---- what anyone may read -------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True once the node is done: it ran its ``rounds`` rounds (or was stopped); end the loop."""
        return self._handoff.ended or self._daemon.stop_flag.is_set()

    @property
    def config(self) -> NodeConfig:
        return self._cfg

    @property
    def node_id(self) -> str:
        return self._daemon.node_id

    @property
    def round(self) -> int:
        """Rounds completed (outer steps applied) so far."""
        return self._daemon.state.round

    @property
    def steps_this_round(self) -> int:
        """Inner steps taken in the round now training."""
        return self._replica.engine.steps_this_round

    @property
    def param_digest(self) -> str:
        """sha256 of the global parameters: the same on every member that completed this round."""
        return self._daemon.state.param_digest

    @property
    def address(self) -> str:
        """The address peers dial (``host:port``), once the node serves."""
        swarm = self._daemon.swarm
        return swarm.advertise if swarm is not None else ""

    def status(self) -> dict[str, Any]:
        """The fields `neuronode status` shows (round, phase, param_digest, loss, val_loss,
        peers, bytes...), read on the node's loop; after the node stopped, its last ones."""
        loop = self._loop
        if self._handoff.ended or loop is None:
            return dict(self._final_status)

        async def read() -> dict[str, Any]:
            return self._status_now()

        try:
            return asyncio.run_coroutine_threadsafe(read(), loop).result(timeout=10)
        except RuntimeError:  # the loop closed meanwhile
            return dict(self._final_status)

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        self.close(abandon=kind is not None)


def library_config(options: Mapping[str, Any]) -> NodeConfig:
    """NodeConfig from Swarm's keywords (flag names with _ for -): `neuronode start`'s defaults
    and checks; the environment and config files are the CLI's alone."""
    for name in options:
        if name not in FIELD_TYPES:
            close = difflib.get_close_matches(name, FIELD_TYPES, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; the keywords are neuronode start's flags with _ for -"
            raise ConfigError(f"neuronode.Swarm: unknown keyword {name}{hint}")
        if name in TRAINER_ONLY:
            raise ConfigError(f"neuronode.Swarm: {name} sets neuronode start's own model or trainer; "
                              "yours have their own settings (leave it out)")
    try:
        return build_config({"task": "library", **options}, environ={})
    except ConfigError as exc:
        raise ConfigError(f"neuronode.Swarm: {exc}") from None


def model_settings(engine: DiLoCo, given: Mapping[str, str] | None) -> dict[str, str]:
    """What members compare at Hello besides the flags: the caller's settings (the parameter
    shapes by default), then the initial weights (the model's parameters as given, before any
    checkpoint: the digest neuronode.training.hf names so too)."""
    if given is None:
        given = {"parameter shapes": f"{engine.num_elements} in {len(engine.manifest())} tensors, "
                                     f"{engine.manifest_hash()[:12]}"}
    out = {str(k): str(v) for k, v in given.items()}
    out.setdefault("initial weights", engine.param_digest()[:16])
    return out


__all__ = ["Swarm", "SwarmError", "library_config", "model_settings"]

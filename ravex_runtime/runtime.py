"""One runtime per decorated call: what the patches call into.

It drives a :class:`~ravex_runtime.session.Session`, which knows what is being
trained, captures, writes in the background and restores, and adds what only
the decorator does: it counts optimizer steps, collects a checkpoint at the top
of an iteration when one is due, restores the newest checkpoint once, at the
first iteration boundary of a resumed run, stops at ``max_steps``, turns SIGTERM
into a last checkpoint, and keeps every failure of its own away from the
training code.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from ravex_convert.errors import RavexError
from ravex_convert.storage import StoreTakenOverError
from ravex_convert.storage.lease import TAKEN_HINT

from .config import Config
from .dist import initialized
from .errors import ResumeError
from .sampler import LoaderState
from .session import Session

__all__ = ["Runtime", "StopRun"]

log = logging.getLogger("ravex")
_WARN_AFTER_STEPS = 3
# After SIGTERM, how many iteration boundaries without an optimizer step to wait for one.
_PREEMPT_WAIT_BOUNDARIES = 64


class StopRun(BaseException):
    """Raised at an iteration boundary once ``max_steps`` is reached; the decorator returns normally.
    A BaseException so that a user's ``except Exception`` does not swallow it."""


class Runtime:
    def __init__(self, cfg: Config, preemption_handler: bool = False):
        self.cfg = cfg
        self.active = True  # checkpointing; off after deactivate() or a failure
        self.counting = True  # step counting and max_steps; off only after deactivate()
        self.preemption_handler = preemption_handler
        self.preempted = False
        self.preempt_waits = 0
        self.preempt_posted: float | None = None  # when this rank told the others of a SIGTERM (many ranks)
        self.stop_step: int | None = None  # the step every rank stops after, once agreed
        self.step = 0
        self.start_step = 0
        self.due = False
        self.boundary_seen = False
        self.warned_boundary = False
        self.steps_since_boundary = 0
        self.hooks: list[Any] = []
        # Strong references to what was being trained at the last boundary: the final checkpoint
        # runs after the function returned, when its locals are gone.
        self.held: list[Any] = []
        # a restore failed for good, or another run took the store over: every later boundary raises it again
        self.fatal: RavexError | None = None
        self.restored = False
        self.last_step_written: int | None = None
        self.error: str | None = None
        # A framework whose restored progress tells the samplers their epoch (Lightning's fit loop):
        # Ravex puts the saved epoch in once and does not shift what the framework passes later.
        self.framework_epochs = False
        self.last_loader: LoaderState | None = None  # whose batch the last boundary was
        # False: the checkpoint's data positions are not continued (a framework positions its data
        # itself, as the HF Trainer does at another world size): every loader starts its epoch afresh.
        self.loader_positions = True
        self.restore_waits: list[Any] = []  # frameworks' predicates: True while a restore must wait (frameworks/)
        # Last: takes the store's run lock and starts the writer (errors raise here, before training).
        # A failing background write switches the decorator off; training goes on.
        self.session = Session(cfg, on_error=self.disable)

    # What ravex.status() reports, kept by the session.

    @property
    def store(self) -> Path:
        return self.session.path

    @property
    def run_id(self) -> str:
        return self.session.run_id

    @property
    def resumed_index(self) -> int | None:
        return self.session.resumed_index

    @property
    def resume_label(self) -> str:
        return self.session.resume_label

    @property
    def last_index(self) -> int | None:
        return self.session.last_index

    @property
    def writes(self) -> int:
        return self.session.writes

    # ------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Find the checkpoint to resume from, load and verify it (errors raise: before training); the
        step count starts from its step."""
        try:
            step = self.session.prepare_restore()
        except BaseException:
            self.session.close()
            raise
        if step is not None:
            self.step = self.start_step = step

    def stop(self, wrote_final: bool) -> None:
        self.session.close()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.held = []
        self.active = self.counting = False

    def disable(self, why: str) -> None:
        taken = self.session.taken_over
        if taken is not None:
            # Another machine took the store over and trains this job from its newest checkpoint:
            # this run's steps can never be saved, and it competes with the replacement for the
            # data and whatever else the script writes. It stops at its next step or iteration
            # boundary with StoreTakenOverError (said once at ERROR already, by the lease).
            self.error = why
            self.active = False
            self.fatal = StoreTakenOverError(taken, hint=TAKEN_HINT, path=self.session.path)
            return
        if self.active and self.session.world_size > 1 and not self.session.left and initialized():
            # On many ranks the next checkpoint is a collective: a rank that stopped alone would
            # leave the others waiting in it. Every rank learns of it there, and all stop together.
            if self.error is None:
                log.error("ravex: %s; every rank stops checkpointing at the next checkpoint boundary", why)
                self.error = why
            return
        if self.active:
            log.error("ravex: disabled for the rest of this run: %s; training continues without checkpoints", why)
        self.error = why
        self.active = False

    # ------------------------------------------------------------ noticing (the session keeps what is tracked)

    def notice_optimizer(self, opt: Any) -> None:
        if self.session.notice_optimizer(opt) == 0:
            # The first optimizer's real steps are the step count (a step a GradScaler skips does not count).
            self.hooks.append(opt.register_step_post_hook(lambda o, a, k: self._safe(self.on_step, always=True)))

    def loader_state(self, loader: Any) -> LoaderState:
        st = self.session.notice_loader(loader)
        st.framework_epochs, st.watched = self.framework_epochs, True
        return st

    def track(self, obj: Any, name: str, *, named: bool = False) -> None:
        """``ravex.track``: a model, optimizer or DataLoader joins the ones noticed; anything else is saved by name.
        ``named``: the user gave ``name`` (a module's recipe goes by it: ``ravex.load_model(path, name=...)``)."""
        if isinstance(obj, torch.nn.Module):
            self.session.notice_module(obj)
            if named:
                self.session.recipes.name(obj, name)
        elif isinstance(obj, torch.optim.Optimizer):
            self.notice_optimizer(obj)
        elif isinstance(obj, torch.utils.data.DataLoader):
            self.session.notice_loader(obj)
        else:
            self.session.notice_stateful(name, obj)

    def _safe(self, fn: Any, *args: Any, always: bool = False) -> Any:
        """Every hook goes through here: a failure in Ravex never reaches the training code.
        ``always``: runs while steps are counted even after checkpointing was switched off by a failure."""
        if self.fatal is not None and always:
            raise self.fatal  # the restore failed for good: no iteration, no step may go on
        if not (self.active or (always and self.counting)):
            return None
        try:
            return fn(*args)
        except (StopRun, SystemExit, ResumeError):
            raise
        except Exception as exc:  # a hook must never break training
            log.exception("ravex: internal error in %s", getattr(fn, "__name__", fn))
            self.disable(f"{type(exc).__name__}: {exc}")
            return None

    # ------------------------------------------------------------ events

    def on_step(self) -> None:
        self.step += 1
        if self.last_loader is not None:
            self.last_loader.trains = True  # its batches are trained on
        self.steps_since_boundary += 1
        if self.step % self.cfg.checkpoint_every == 0:
            self.due = True
        if not self.boundary_seen and not self.warned_boundary and self.step - self.start_step >= _WARN_AFTER_STEPS:
            self.warned_boundary = True
            log.warning("ravex: %d optimizer steps and no iteration boundary seen: no DataLoader is iterated and ravex.batch_boundary() "
                        "is not called, so no checkpoint can be collected; call ravex.batch_boundary() at the top of each iteration",
                        self.step - self.start_step)

    def boundary(self, loader: LoaderState | None = None) -> None:
        """The top of an iteration: restore (once), then checkpoint when due, stop at max_steps or on SIGTERM.
        ``loader``: the DataLoader whose next batch this is. One that no optimizer step has followed
        yet (an evaluation's, run between two training steps) only restores: a checkpoint taken in
        the middle of an evaluation would resume after it, without the rest of it."""
        taken = self.session.taken_over
        if taken is not None and self.fatal is None:
            self.disable(taken)  # the lease's renewal learnt it: the run stops at its next step (fatal)
            return
        if loader is not None:
            self.last_loader = loader
            if not loader.trains:
                if self.active and not self.restored and not self.restore_deferred():
                    self.restore()
                return
        if not self.active:
            if self.counting and self.at_max_steps():
                raise StopRun()
            return
        first, self.boundary_seen = not self.boundary_seen, True
        stepped, self.steps_since_boundary = self.steps_since_boundary > 0, 0
        live = self.session.tracked()
        if first:
            self.session.recipes.recipes(live)  # a model without a recipe is said at the start (once), not at the first checkpoint
        self.held = [*live.models, *live.optimizers, *live.schedulers, *live.scalers, *(ld for ld, _ in live.loaders if ld is not None)]
        if not self.restored:
            self.restore()
        coord = self.session.coord if self.session.join() else None
        if coord is not None:
            self._preempt_together(coord, stepped)
        elif self.preempted and not stepped and self.preempt_waits < _PREEMPT_WAIT_BOUNDARIES:
            # Mid-way through gradient accumulation the gradients are part of the state and no
            # checkpoint holds them: wait for the boundary after the next optimizer step.
            self.preempt_waits += 1
        elif self.preempted:
            self.collect()
            self.flush()
            if self.error is None:
                log.warning("ravex: SIGTERM received; checkpoint at step %d written, exiting", self.step)
            else:
                log.error("ravex: SIGTERM received; the checkpoint at step %d could not be written (%s), exiting", self.step, self.error)
            raise SystemExit(0)
        if self.due:
            self.due = False
            self.collect()
        if self.cfg.max_steps is not None and self.step >= self.cfg.max_steps:
            if coord is not None and self.last_step_written != self.step and self.step > self.start_step:
                self.collect()  # every rank is here, at the same step: the last checkpoint now, not at exit
            raise StopRun()

    def _preempt_together(self, coord: Any, stepped: bool) -> None:
        """SIGTERM on any rank of the job: every rank writes the checkpoint of the same step and
        exits 0 (the protocol is in dist.py). Costs nothing until a rank is signalled."""
        if not (self.preempted or coord.remote_preempt.is_set()):
            return
        if self.preempt_posted is None:
            coord.post_preempt(self.step)
            self.preempt_posted = time.monotonic()
        if self.stop_step is None:
            self.stop_step = coord.preempt_stop()
            if self.stop_step is None:
                if time.monotonic() - self.preempt_posted > coord.wait_timeout().total_seconds():
                    log.error("ravex: SIGTERM: not every rank answered in %d s; exiting without a last checkpoint", coord.wait_timeout().total_seconds())
                    raise SystemExit(0)
                return
        if self.step >= self.stop_step and stepped:
            self.collect()
            self.flush()
            if self.error is None:
                log.warning("ravex: SIGTERM received by a rank of the job; every rank stopped at step %d, its checkpoint is written, exiting", self.step)
            else:
                log.error("ravex: SIGTERM received by a rank of the job; the checkpoint at step %d could not be written (%s), exiting",
                          self.step, self.error)
            raise SystemExit(0)

    def before_destroy(self) -> None:
        """The script destroys its process group (at its end): the last checkpoint of a run on many
        ranks is written first, when every rank is known to be here; then the ranks part."""
        if self.session.coord is None:
            return
        self.final_checkpoint()
        self.session.leave()

    def final_checkpoint(self, consistent: bool = True) -> None:
        """The run's last checkpoint, at its end (the decorated function returned or raised, or the
        script is destroying its process group): written when the state is ``consistent`` (not in
        the middle of a step), steps were taken since the last one written, and, on many ranks,
        every rank is known to have reached the end at the same step (a collective)."""
        if consistent and self.step > self.start_step and self.last_step_written != self.step and self._all_here():
            if not self.restored:
                self.restore()
            self.collect(final=True)

    def _all_here(self) -> bool:
        """On many ranks the final checkpoint is a collective: written only when every rank is known to
        have reached the end at the same step (a bounded wait), never waiting on a rank that is gone."""
        session = self.session
        if session.coord is None:
            if session.world_size > 1 and session.rank == 0:
                log.error("ravex: no final checkpoint at step %d: the ranks can no longer agree on one (the process group is gone, or was never "
                          "initialized); the last checkpoint written stays the newest", self.step)
            return bool(session.world_size == 1)
        together, missing = session.coord.all_here(self.step)
        if not together:
            log.error("ravex: no final checkpoint at step %d: %s; the last checkpoint written stays the newest", self.step,
                      f"rank(s) {', '.join(map(str, missing))} did not reach the end within {int(session.coord.exit_wait_s)} s" if missing
                      else "the ranks ended at different steps")
        return bool(together)

    def boundary_restore_only(self) -> None:
        """``iter(loader)``: restore (once) before the iterator is built, so it can continue the saved position."""
        if not self.restored and not self.restore_deferred():
            self.restore()

    def restore_deferred(self) -> bool:
        """A framework says this is no place to restore: what it iterates now runs inside a block that
        puts the random state back after it (Lightning's sanity check, in ``isolate_rng``)."""
        return any(wait() for wait in self.restore_waits)

    def at_max_steps(self) -> bool:
        return self.counting and self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    # ------------------------------------------------------------ collection, writing, restore: the session's

    def collect(self, final: bool = False) -> None:
        """Capture the state now (training thread) and commit it to the session's writer."""
        if not self.active:
            return
        if self.last_step_written == self.step and final:
            return
        coord = self.session.coord if self.session.join() else None
        if coord is not None:
            # the one tiny exchange that keeps the ranks together: has any of them stopped?
            stopped = [(r, e) for r, e in enumerate(coord.all_gather(self.error or self.session.error)) if e is not None]
            if stopped:
                self.active = False
                self.error = self.error or f"rank {stopped[0][0]}: {stopped[0][1]}"
                if self.session.rank == 0:
                    log.error("ravex: disabled for the rest of this run on every rank (rank %d: %s); training continues without checkpoints",
                              *stopped[0])
                return
        if not self.session.tracked().models:
            log.warning("ravex: no model is known at step %d (none was built inside the decorated function, or it is gone); "
                        "no checkpoint is written. Use ravex.track(model).", self.step)
            return
        snap = self.session.capture(self.step)
        self.last_step_written = self.step
        self.session.commit(snap)

    def flush(self) -> None:
        self.session._drain()  # never raises: a failed write has already switched the decorator off

    def restore(self) -> None:
        """Put the resume checkpoint into the live objects (at the first iteration boundary), all or nothing.
        One that does not fit them is reported and the previous complete checkpoint tried; when none is
        left, :class:`ResumeError` stops the run before its first step."""
        self.restored = True
        try:
            step = self.session.restore()
        except ResumeError as exc:
            self.fatal = exc
            self.error = exc.message
            self.active = self.counting = False
            log.error("ravex: the run stops before its first step: %s", exc.message.splitlines()[0])
            raise
        if not self.loader_positions:
            for _, st in self.session.tracked().loaders:
                st.pending = None
        if step is not None:
            self.step = self.start_step = step

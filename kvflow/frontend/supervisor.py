"""Self-healing: the frontend's engine handle that restarts a dead or hung engine and resumes
every unfinished request (docs/design.md, "Self-healing").

`SupervisedEngine` wraps `MultiprocEngine` with the same interface (add_requests, abort,
get_outputs, drain, utility, shutdown). It remembers every request it passed on: the
EngineRequest and each token the engine produced for it. When the engine dies (EngineCore or
a worker: a crash, SIGKILL, the OOM killer) or is declared hung (a worker: EngineCore's step
watchdog reports it; EngineCore itself: silent for `step_timeout` while requests are pending),
it kills what is left of the old engine, starts a new one with the same configuration and
sends every unfinished request again, in their order, as a continuation: the same prompt with
the tokens produced so far as `output_token_ids` (the new engine prefills both, counts them
against max_tokens and min_tokens, and seeded sampling goes on from their position). The
consumer's trackers never notice: their streams pause, then go on.

Bounded: at most `max_engine_restarts` restarts within RESTART_WINDOW seconds; past that it
gives up as kvflow did before (EngineDeadError for every request, `dead` set).

Poison pills: the requests of the step an engine died in (EngineCore names them) are
suspects. Suspects go back to the new engine one at a time and are cleared once they produce
a token, so a second crash names at most one of them; a request that was in the step of
POISON_CRASHES crashes is failed alone, with an error, and not sent again.

Two modes. `restart_in_thread=False` (LLM, launch.py generate): a restart blocks the caller.
`True` (the server): the new engine starts in a thread while the event loop serves on
(/health says "restarting"); `pollables()` then holds a pipe that wakes the reader when the new
engine is ready, and requests submitted meanwhile are held and sent then.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil
import zmq

from kvflow.config import EngineConfig
from kvflow.errors import EngineDeadError
from kvflow.frontend.engine_client import MultiprocEngine
from kvflow.ipc.messages import (EngineOutputs, EngineRequest, EngineStats, FinishReason,
                                 RequestDelta, UtilityCall)

logger = logging.getLogger(__name__)

RESTART_WINDOW = 600.0       # seconds: max_engine_restarts counts restarts within this window
POISON_CRASHES = 2           # a request in the step of this many crashes is not sent again
POISON_ERROR = ("internal error: this request was in the step of {n} engine crashes; it is "
                "not retried (the server's log has the details)")


@dataclass
class Tracked:
    request: EngineRequest
    outputs: list[int] = field(default_factory=list)   # tokens produced, in order
    crashes: int = 0               # crashed steps it was in since it last produced a token
    sent: bool = False             # at the current engine
    ever_sent: bool = False        # taken in by some engine (counted as received)


class SupervisedEngine:
    def __init__(self, config: EngineConfig, restart_in_thread: bool = False,
                 on_restart: Callable[[str, int], None] | None = None) -> None:
        self.config = config
        self.engine: MultiprocEngine | None = MultiprocEngine(config)   # errors propagate
        self.num_blocks = self.engine.num_blocks
        self.restart_in_thread = restart_in_thread
        self.on_restart = on_restart          # (cause, number of requests resumed)
        self.tracked: dict[str, Tracked] = {}
        self.held: set[str] = set()           # tracked, not at the current engine
        self.dead: str | None = None
        self.generation = 0                   # bumped at every restart (pollables change)
        self.restart_times: list[float] = []
        self.stats = EngineStats()
        self.offset = 0                       # requests taken in by earlier engines
        self.num_ever_sent = 0
        self.replies: list[RequestDelta] = []     # made here: aborts, poison pills
        self._cause = ""
        self._new: MultiprocEngine | BaseException | None = None   # the restart thread's
        self._thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None     # killing an engine given up on
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._children = _descendants(self.engine)   # known while EngineCore lives

    # --- what the consumers call ---------------------------------------------------------

    @property
    def restarting(self) -> bool:
        return self.engine is None and self.dead is None

    def add_requests(self, requests: list[EngineRequest]) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        batch = []
        for request in requests:
            t = self.tracked[request.request_id] = Tracked(request)
            self.held.add(request.request_id)
            batch.append(t)
        if self.engine is not None:
            self._send(batch)                 # held while restarting, sent at the install
        self._wake()                          # a death seen while sending: drain() handles it

    def abort(self, request_ids: list[str]) -> None:
        """Forget them at once and answer their abort here: an abort sent to an engine that
        then dies would otherwise never be answered."""
        at_engine = []
        for request_id in request_ids:
            t = self.tracked.pop(request_id, None)
            if t is None:
                continue
            self.held.discard(request_id)
            if t.sent:
                at_engine.append(request_id)
            elif not t.ever_sent:             # no engine will count it: count it taken in
                t.ever_sent = True
                self.num_ever_sent += 1
                self.offset += 1
            self.replies.append(RequestDelta(request_id, [], FinishReason.ABORT))
        if at_engine and self.engine is not None and self.engine.dead is None:
            self.engine.abort(at_engine)
        self._release_suspect()
        if self.replies:
            self._wake()

    def drain(self) -> list[EngineOutputs]:
        """Every output waiting now, without blocking. A dead or hung engine is restarted
        here (in a thread, or inline); EngineDeadError only once restarts are used up."""
        _drain_pipe(self._wake_r)
        found = self._take_replies()
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.engine is None:
            self._install_if_ready()
            return found + self._take_replies()
        try:
            if self.engine.dead is not None:  # seen while sending
                raise EngineDeadError(self.engine.dead, self.engine.dead_request_ids)
            for outputs in self.engine.drain():
                found.append(self._track(outputs))
            self._check_hung()
        except EngineDeadError as e:
            self._died(str(e), e.request_ids)
        return found + self._take_replies()

    def get_outputs(self, timeout: float | None = None) -> EngineOutputs | None:
        """The outputs that come next, waiting at most `timeout` (None: until some come)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found = self.drain()
            if found:
                return EngineOutputs([d for o in found for d in o.outputs], found[-1].stats)
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                return None
            if self.engine is None or self.engine.dead is not None:
                time.sleep(min(wait, 0.05))
                continue
            try:                              # wait for the engine (1 s at most: hangs)
                outputs = self.engine.get_outputs(wait)
            except EngineDeadError:
                continue                      # drain() restarts it
            if outputs is not None:
                tracked = self._track(outputs)
                return EngineOutputs(tracked.outputs + [d for o in self._take_replies()
                                                        for d in o.outputs], tracked.stats)

    def pollables(self) -> list[zmq.Socket | int]:
        """What a reader polls: the engine's output socket and pidfd, and the wake pipe."""
        if self.engine is None:
            return [self._wake_r]
        return [self.engine.output.sock, self.engine.sentinel, self._wake_r]

    def utility(self, call: UtilityCall, timeout: float = 30.0) -> dict[str, float]:
        if self.engine is None:
            raise EngineDeadError(self.dead or "the engine is restarting")
        return self.engine.utility(call, timeout)

    def shutdown(self) -> None:
        self._closing = True
        if self._thread is not None:          # a restart under way stops its new engine
            self._thread.join(5)
            if isinstance(self._new, MultiprocEngine):
                self._new.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
        if self._reaper is not None:          # nothing of a dead engine outlives shutdown()
            self._reaper.join(10)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # --- following requests ----------------------------------------------------------------

    def _send(self, batch: list[Tracked]) -> None:
        """To the current engine, in one message; a death seen here is left for drain()
        (engine.dead)."""
        engine = self.engine
        assert engine is not None
        if engine.dead is not None or not batch:
            return
        if not any(x.sent for x in self.tracked.values()):
            engine.last_heard = time.monotonic()    # it was idle: silence so far is no hang
        try:
            engine.add_requests([EngineRequest(t.request.request_id, t.request.prompt_token_ids,
                                               t.request.sampling_params,
                                               t.request.arrival_time, list(t.outputs))
                                 for t in batch])
        except EngineDeadError:
            return
        for t in batch:
            t.sent = True
            self.held.discard(t.request.request_id)
            if t.ever_sent:
                self.offset -= 1              # counted by an earlier engine already
            else:
                t.ever_sent = True
                self.num_ever_sent += 1

    def _track(self, outputs: EngineOutputs) -> EngineOutputs:
        for delta in outputs.outputs:
            t = self.tracked.get(delta.request_id)
            if t is None:
                continue
            t.outputs.extend(delta.new_token_ids)
            if delta.new_token_ids:
                t.crashes = 0                 # it ran a step and the engine lived
            if delta.finish_reason is not None:
                del self.tracked[delta.request_id]
                self.held.discard(delta.request_id)
        outputs.stats.num_received += self.offset
        self.stats = outputs.stats
        self._release_suspect()
        return outputs

    def _take_replies(self) -> list[EngineOutputs]:
        if not self.replies:
            return []
        replies, self.replies = self.replies, []
        return [EngineOutputs(replies, self.stats)]

    def _release_suspect(self) -> None:
        """Send what is held, in order: every request that is no suspect, and suspects one at
        a time (the next once none is unproven at the engine)."""
        if not self.held or self.engine is None or self.engine.dead is not None:
            return
        suspect_out = any(t.sent and t.crashes for t in self.tracked.values())
        for t in self.tracked.values():
            if t.sent or (t.crashes and suspect_out):
                continue
            self._send([t])
            suspect_out = suspect_out or bool(t.crashes)

    # --- death, hangs, restarts --------------------------------------------------------------

    def _check_hung(self) -> None:
        """EngineCore says it lives at least every second while it has work (a heartbeat while
        a step runs): silence for step_timeout with requests at it is a hang."""
        assert self.engine is not None
        silence = time.monotonic() - self.engine.last_heard
        if silence > self.config.step_timeout and len(self.tracked) > len(self.held):
            self._died(f"EngineCore (pid {self.engine.proc.pid}) hung: nothing from it for "
                       f"{silence:.1f} s (--step-timeout) while requests were pending", [],
                       cause="hung")

    def _died(self, reason: str, suspects: list[str], cause: str | None = None) -> None:
        old = self.engine
        assert old is not None
        self.engine = None
        self.generation += 1
        cause = cause or _cause(reason)
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < RESTART_WINDOW]
        if len(self.restart_times) >= self.config.max_engine_restarts:
            self.dead = reason
            logger.error("the engine died (%s) and %d restart(s) in %.0f s are used up "
                         "(--max-engine-restarts): giving up: %s", cause,
                         self.config.max_engine_restarts, RESTART_WINDOW, reason)
            self._reaper = threading.Thread(target=_kill, args=(old, self._children),
                                            daemon=True, name="kvflow-reap")
            self._reaper.start()                      # said at once, reaped meanwhile
            raise EngineDeadError(reason)
        self.restart_times.append(now)
        logger.error("the engine died (%s); restarting it and resuming %d request(s): %s",
                     cause, len(self.tracked), reason)
        for request_id in set(suspects):   # once per crash (async: in two planned steps)
            t = self.tracked.get(request_id)
            if t is not None:
                t.crashes += 1
        self.held = set(self.tracked)
        for request_id, t in list(self.tracked.items()):
            t.sent = False
            if t.crashes >= POISON_CRASHES:
                logger.error("request %s was in the step of %d crashes: failed, not resumed",
                             request_id, t.crashes)
                del self.tracked[request_id]
                self.held.discard(request_id)
                self.replies.append(RequestDelta(request_id, [], FinishReason.ERROR,
                                                 error=POISON_ERROR.format(n=t.crashes)))
        self._cause = cause
        if self.restart_in_thread:
            self._thread = threading.Thread(target=self._restart, args=(old, self._children),
                                            name="kvflow-restart", daemon=True)
            self._thread.start()
        else:
            self._restart(old, self._children)
            self._install_if_ready()

    def _restart(self, old: MultiprocEngine, children: list[psutil.Process]) -> None:
        """Kill what is left of the old engine and start a new one (a thread, or inline)."""
        start = time.monotonic()
        try:
            _kill(old, children)
            if self._closing:
                raise EngineDeadError("shutting down")
            new = MultiprocEngine(self.config)
            if self._closing:                 # shut down while it started
                new.shutdown()
                raise EngineDeadError("shutting down")
            self._children = _descendants(new)
            logger.info("the new engine is ready in %.1f s", time.monotonic() - start)
            self._new = new
        except BaseException as e:                # noqa: BLE001 - handed to the consumer
            self._new = e
        self._wake()

    def _install_if_ready(self) -> None:
        new = self._new
        if new is None:
            return
        self._new, self._thread = None, None
        _drain_pipe(self._wake_r)
        if not isinstance(new, MultiprocEngine):
            self.dead = f"the engine could not be restarted: {new}"
            logger.error("%s", self.dead)
            raise EngineDeadError(self.dead)
        self.engine = new
        self.generation += 1
        self.offset = self.num_ever_sent
        self.stats = EngineStats(num_received=self.offset)   # not the old engine's totals
        self._release_suspect()
        resumed = sum(t.sent for t in self.tracked.values())
        logger.warning("engine restarted (%s): %d request(s) resumed, %d held as suspects",
                       self._cause, resumed, len(self.tracked) - resumed)
        if self.on_restart is not None:
            self.on_restart(self._cause, len(self.tracked))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (OSError, ValueError):
            pass


def _cause(reason: str) -> str:
    """A metric label: which process failed."""
    if "hung" in reason:
        return "hung"
    return "worker" if "worker" in reason or "node" in reason else "engine_core"


def _descendants(engine: MultiprocEngine) -> list[psutil.Process]:
    """EngineCore's workers, taken while EngineCore lives (once it is dead they are another
    process's children). psutil checks a process's start time, so a reused pid is never hit."""
    try:
        return psutil.Process(engine.proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill(engine: MultiprocEngine, known: list[psutil.Process]) -> None:
    """Stop an engine that died or hung, leaving nothing behind: EngineCore's descendants
    (those known from its start and those there now) are killed outright (a stopped or hung
    worker cannot stop itself), then EngineCore, through its pidfd (no reused pid is hit)."""
    children = {p.pid: p for p in [*known, *_descendants(engine)]}.values()
    for p in children:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    try:
        signal.pidfd_send_signal(engine.proc.sentinel, signal.SIGKILL)
    except (OSError, ValueError):
        pass                                  # already reaped
    engine.shutdown()
    _wait_gone(list(children), 5.0)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Until each is gone or a zombie (the workers of a dead EngineCore belong to PID 1 now,
    which in a container may never reap them); never longer than `timeout`."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:              # gone
                break
            time.sleep(0.02)


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass

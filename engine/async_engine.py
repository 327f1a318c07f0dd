"""The loop a server drives: one engine thread steps the model; asyncio callers add requests,
iterate their outputs and abort them. The event loop never waits on model work."""
import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .core import EngineCore, RequestOutput
from .sampler import SamplingParams

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class EngineStopped(EngineDead):
    """The server is shutting down: new requests are refused, in-flight ones aborted."""


class AsyncEngine:
    def __init__(self, core: EngineCore):
        if core.driver is not None:
            raise RuntimeError("this engine core is already driven by another AsyncEngine")
        self.core = core
        core.driver = self
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.stopping = False
        self._thread.start()

    # ---- called from the event loop ----
    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative RequestOutput after every step that advanced it."""
        if self.error is not None:
            raise EngineDead(f"the engine loop died: {self.error!r}")
        if self.stopping:
            raise EngineStopped("the server is shutting down")
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._cmds.put(("add", rid, prompt, params))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the caller went away (client disconnect): free its cache
                self._cmds.put(("abort", rid))

    def abort(self, request_id: str):
        self._cmds.put(("abort", request_id))

    def stop_accepting(self):
        """Shutdown's first half, safe from a signal handler: refuse new requests and end every
        in-flight one now (its handler answers 503, or ends its stream), so that a server told to
        exit is not held open by long generations; the engine thread aborts them and frees their cache."""
        self.stopping = True
        for rid in list(self._streams):
            self._deliver(rid, EngineStopped("the server is shutting down; the request was aborted"))
            self._cmds.put(("abort", rid))

    def shutdown(self, timeout: float = 5.0):
        self.stop_accepting()
        self._stop.set()
        self._cmds.put(("noop",))
        self._thread.join(timeout=timeout)  # a step in flight finishes; the thread is a daemon anyway
        self.core.driver = None

    # ---- the engine thread ----
    def _deliver(self, rid: str, item):
        stream = self._streams.get(rid)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass

    def _handle(self, cmd):
        if cmd[0] == "add":
            _, rid, prompt, params = cmd
            try:
                self.core.add_request(prompt, params, request_id=rid)
            except Exception as e:  # bad input or overload: only this request fails
                self._deliver(rid, e)
        elif cmd[0] == "abort":
            self.core.abort(cmd[1])

    def _run(self):
        try:
            while not self._stop.is_set():
                block = not self.core.has_unfinished()
                try:
                    cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
                    self._handle(cmd)
                    while True:
                        self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                if self.core.has_unfinished():
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # a dead loop must not hang its callers
            log.exception("engine loop died")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDead(f"the engine loop died: {e!r}"))

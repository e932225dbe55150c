"""The engine core's end: its death told to whoever waits on it, and its shutdown given time.

vLLM's offline client (`SyncMPClient`) waits without a bound: `LLM.generate` on its output queue,
`LLM.collective_rpc` on a future. When the engine core process dies (a terminal's Ctrl-C reaches it
with the caller, the out-of-memory killer, a crash in a kernel), vLLM's own monitor marks the client
dead and stops its output thread, but posts nothing to the queue or the futures: the caller would
wait forever. `watch` gives each engine one more monitor that posts vLLM's `EngineDeadError` to
both, and `died` turns that error into the caller's: the interrupt, where one is pending, or an
`EngineError` saying what died.

`shut_down` stops an engine hookscope made. vLLM's client gives its engine core 5 s to stop, while
the core itself gives its workers 5 s before it terminates them: on a busy machine the client kills
the core first, and the core's shared memory (its executor's message queue, in /dev/shm) is left
to Python's resource tracker, which removes it at exit with a "leaked shared_memory" warning.
"""

from __future__ import annotations

import contextlib
import threading
import time
from multiprocessing import connection

from ...errors import EngineDied

# time for the engine core to stop its workers and remove its shared memory (a bound: it stops sooner)
SHUTDOWN_GRACE_S = 30.0
# how long a dead engine core's error waits for an interrupt this process may still have to handle:
# a Ctrl-C reaches the engine's processes and this one at once, and the core's death can be seen
# first; the interrupt is then the cause to report, not the death
INTERRUPT_GRACE_S = 1.0
# how long after the death the calls made meanwhile still get vLLM's EngineDeadError
LATE_CALLS_S = 30.0


def _processes(engine) -> list:
    """The engine core processes of the engine's client; none for an in-process engine core."""
    manager = getattr(getattr(engine.llm_engine.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", ()))


def watch(engine) -> None:
    """Start, once per engine, the thread that posts the engine core's death to the client's waits."""
    client = engine.llm_engine.engine_core
    processes = _processes(engine)
    if not processes or getattr(client, "_hookscope_watched", False):
        return
    client._hookscope_watched = True
    threading.Thread(
        target=_post_death, args=(client, processes), daemon=True, name="hookscope-engine-watch"
    ).start()


def _post_death(client, processes: list) -> None:
    connection.wait([p.sentinel for p in processes])  # returns when one of them has ended
    from vllm.v1.engine.exceptions import EngineDeadError

    queue = getattr(client, "outputs_queue", None)
    if queue is not None:
        queue.put_nowait(EngineDeadError())
    # the waits of calls made after the death too (a cleanup's, sent before vLLM's own monitor marks
    # the client dead), for as long as an error's handling takes
    end = time.monotonic() + LATE_CALLS_S
    while time.monotonic() < end:
        for future in list(getattr(client, "utility_results", {}).values()):
            with contextlib.suppress(Exception):  # answered meanwhile: nothing to tell it
                future.set_exception(EngineDeadError())
        time.sleep(0.1)


def dead(engine) -> bool:
    """Whether one of the engine's core processes has ended."""
    return any(p.exitcode is not None for p in _processes(engine))


def is_death(engine, exc: BaseException) -> bool:
    """Whether `exc` reports a dead engine core: vLLM's `EngineDeadError`, or any error of a call
    during which an engine core process ended (a socket closed under it, a worker's reply lost)."""
    named = any(type(e).__name__ == "EngineDeadError" for e in (exc, exc.__cause__, exc.__context__))
    return named or dead(engine)


def died(engine) -> EngineDied:
    """The error for a dead engine core, once a pending interrupt had its chance to be raised."""
    time.sleep(INTERRUPT_GRACE_S)  # a pending Ctrl-C is raised here, in the main thread
    ended = [
        f"{p.name} (pid {p.pid}, exit code {p.exitcode})"
        for p in _processes(engine)
        if p.exitcode is not None
    ]
    what = (
        f"the vLLM engine died during the call: {', '.join(ended) or 'its engine core process'} ended "
        "(a signal, the out-of-memory killer or a crash: see its log above)"
    )
    return EngineDied(what, "this engine cannot be used again: make a new one")


def shut_down(engine) -> None:
    """Stop the engine's core and worker processes now, letting the core clean up after itself."""
    engine.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)

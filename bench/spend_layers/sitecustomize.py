"""Where a ``ledger serve`` process spends its CPU, by layer, under ``bench/ledger.py``.

Python imports ``sitecustomize`` at start from the path; with this folder on ``PYTHONPATH`` and
``SPEND_LAYERS_OUT`` set, a process started as ``… serve …`` (``bench/ledger.py`` starts one
per backend, and keeps ``PYTHONPATH`` but not ``LEDGER_*`` variables — hence ``SPEND_LAYERS_OUT``)
adds ``time.thread_time()`` around the ledger's functions (no profiler: cProfile's overhead
distorts this path 3–5×), times the garbage collector, and every half second records each
thread's CPU from ``/proc/self/task``. At ``SIGTERM`` (uvicorn re-raises it after its shutdown)
it writes ``<SPEND_LAYERS_OUT>-<pid>.json``; ``report.py`` prints the hot loop's share per spend.
Nothing here runs in any other process, nor when the variable is unset.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("SPEND_LAYERS_OUT") and "serve" in sys.argv:
    import collections
    import functools
    import gc
    import json
    import signal
    import threading
    import time
    from collections.abc import Callable
    from typing import Any

    _OUT = f"{os.environ['SPEND_LAYERS_OUT']}-{os.getpid()}.json"
    _cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
    _calls: collections.Counter[str] = collections.Counter()
    _snapshots: list[dict[str, Any]] = []
    _gc_started: dict[int, float] = {}

    def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                _cpu[name] += time.thread_time() - started
                _calls[name] += 1

        return wrapper

    def _collector(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            _gc_started[threading.get_ident()] = time.thread_time()
            return
        name = f"gc generation {info['generation']}"
        _cpu[name] += time.thread_time() - _gc_started.pop(threading.get_ident(), time.thread_time())
        _calls[name] += 1

    def _install() -> None:
        """Wrap the ledger's functions once the app has imported them (names looked up at call
        time: module attributes and the engine's domain)."""
        wanted = ("service.app", "service.api.deps", "service.ledger.spending.decisions")
        while not all(m in sys.modules for m in wanted):
            time.sleep(0.01)
        time.sleep(0.5)
        from service.api import deps
        from service.ledger import spending
        from service.ledger.spending import decisions, engine, store

        deps.authenticate_many = _timed("auth lookup", deps.authenticate_many)
        engine.SpendEngine.run_group = _timed("ledger group (run_group)", engine.SpendEngine.run_group)
        engine._group_transaction = _timed("  its transaction's work", engine._group_transaction)
        store.Work.open = classmethod(_timed("    head read (Work.open)", store.Work.open.__func__))
        store.Work.flush = _timed("    writes (Work.flush)", store.Work.flush)
        decisions._certify = _timed("      certificate", decisions._certify)
        domain = spending.ENGINE.domain
        object.__setattr__(domain, "decide", _timed("    decide", domain.decide))
        object.__setattr__(domain, "prepare", _timed("pricing (prepare)", domain.prepare))

    def _snapshot() -> dict[str, Any]:
        threads: dict[str, float] = {}
        ticks = os.sysconf("SC_CLK_TCK")
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue
            name = "event-loop thread" if int(tid) == os.getpid() else "other threads"
            threads[name] = threads.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
        return {"t": time.time(), "threads": threads, "cpu": dict(_cpu), "calls": dict(_calls)}

    def _record() -> None:
        while True:
            time.sleep(0.5)
            _snapshots.append(_snapshot())

    def _write(*_args: Any) -> None:
        _snapshots.append(_snapshot())
        with open(_OUT, "w") as out:
            json.dump(_snapshots, out)
        os._exit(0)

    gc.callbacks.append(_collector)
    threading.Thread(target=_install, daemon=True).start()
    threading.Thread(target=_record, daemon=True).start()
    signal.signal(signal.SIGTERM, _write)

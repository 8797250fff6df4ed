"""One pool of real gloo processes per test session, reused by many cases.

Starting 4 processes that import torch, transformers and timm costs about 13 s on 2 cores, so
the pool starts once (``Pool.start``) and each case is a function run on every rank::

    results = pool.run("workers:train_case", "gpt2", plan_json)   # one result per rank

A case function is named ``"module:function"`` (modules importable from ``tests/dist``); it
gets ``*args`` and returns something picklable. An exception on any rank is raised in the
test with that rank's traceback. A case that hangs (a collective some rank never joins) is
reported after ``timeout`` seconds and the pool is torn down (the next case starts a new one).
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _recent_collectives(last: int = 16) -> str:
    """This rank's last collectives from the flight recorder (process group, op, sizes, state)."""
    import json

    import torch

    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, False)  # (collectives, not only active ones)
        entries = json.loads(raw.decode() if isinstance(raw, bytes) else raw).get("entries", [])
    except Exception as err:  # noqa: BLE001 - a diagnostic only
        return f"\n(no flight recorder trace: {err})"
    lines = [f"  pg {e.get('process_group', ['?'])[0]} #{e.get('collective_seq_id')} {e.get('profiling_name')} "
             f"in {e.get('input_sizes')} out {e.get('output_sizes')} {e.get('state')}" for e in entries[-last:]]
    return "\nthis rank's last collectives (flight recorder):\n" + "\n".join(lines)


def _lost_connection(text: str) -> bool:
    """Whether a case's failure is its processes losing each other (see ``Pool.run``)."""
    return any(m in text for m in ("dead, exit code", "Connection reset by peer", "Connection closed by peer"))


class CaseError(RuntimeError):
    """A case raised on some rank, or timed out."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, log: str) -> None:
    # A fatal signal or a hang writes every thread's stack to this rank's log, which the test's
    # error message quotes (a spawned worker's stderr is not the test's).
    trace = open(log, "w", buffering=1)  # noqa: SIM115 - open for the life of the worker
    os.dup2(trace.fileno(), 2)  # what C++ prints before an abort (gloo's collective mismatch) too
    faulthandler.enable(file=trace)
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=True)
    for p in (HERE, ROOT):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The flight recorder keeps this rank's last collectives (every process group): a case that
    # fails reports them, so that a desynchronised rank shows where its sequence left the others'.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results.put((rank, "ready", None))
    while True:
        job = tasks.get()
        if job is None:
            break
        key, name, args, kwargs, timeout = job
        trace.seek(0)  # the log holds this case only
        trace.truncate()
        # A case that hangs prints every rank's stack before the test reports the timeout.
        faulthandler.dump_traceback_later(max(1.0, timeout - 5), exit=False, file=trace)
        try:
            mod_name, fn_name = name.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            out = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the test with the traceback
            out = ("error", traceback.format_exc() + _recent_collectives())
        faulthandler.cancel_dump_traceback_later()
        results.put((rank, key, out))
    dist.destroy_process_group()


class Pool:
    """``world`` gloo processes (see module docstring)."""

    def __init__(self, world: int = 4):
        self.world = world
        self.procs = []
        self._key = 0
        self.logs = []
        self.generation = 0
        """How many times the workers were started: a case that ran again on a fresh pool
        (:meth:`run`) sees per-process counters start from zero."""

    def start(self, timeout: float = 300.0) -> "Pool":
        self.generation += 1
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        port = _free_port()
        t0 = time.time()
        self._logdir = tempfile.mkdtemp(prefix="autopar-pool-")
        self.logs = [os.path.join(self._logdir, f"rank{r}.log") for r in range(self.world)]
        for r in range(self.world):
            p = ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results, self.logs[r]),
                            daemon=True)
            p.start()
            self.procs.append(p)
        ready = 0
        while ready < self.world:
            try:
                _, what, _ = self.results.get(timeout=max(1.0, timeout - (time.time() - t0)))
            except queue.Empty:
                why = self._why([r for r in range(self.world)])
                self.close()
                raise CaseError(f"the {self.world} gloo workers did not start within {timeout:.0f} s{why}") from None
            ready += what == "ready"
        self.start_seconds = time.time() - t0
        return self

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, name: str, *args, timeout: float = 600.0, **kwargs) -> list:
        """Run ``name(*args, **kwargs)`` on every rank; the results in rank order.

        A case whose ranks lost their connections (a worker process died, or gloo reported a
        connection reset or closed by a peer) is run once more on a fresh pool, its first failure
        given in full as a warning (in the run's summary): such a failure says nothing about the
        numbers the case checks, and the second run must pass on its own. Any other failure (an
        assertion, a wrong shape, a hang with every worker alive) is raised at once."""
        try:
            return self._run_once(name, args, kwargs, timeout)
        except CaseError as err:
            if not _lost_connection(str(err)):
                raise
            # A warning reaches the run's summary (pytest keeps a passing test's output to itself).
            warnings.warn(f"case {name} lost a worker or its connections and ran once more on a fresh pool; "
                          f"the first failure:\n{err}", RuntimeWarning, stacklevel=2)
            self.close()
            self.start()
            return self._run_once(name, args, kwargs, timeout)

    def _run_once(self, name: str, args, kwargs, timeout: float) -> list:
        if not self.alive:  # a previous case failed with a hang: start a fresh pool
            self.close()
            self.start()
        self._key += 1
        key = self._key
        for q in self.tasks:
            q.put((key, name, args, kwargs, timeout))
        out, errors = [None] * self.world, {}
        t_start = time.time()
        deadline = t_start + timeout
        got = 0
        while got < self.world:
            try:
                # In short waits: a worker that died is noticed at once, not at the deadline.
                rank, k, res = self.results.get(timeout=max(0.1, min(5.0, deadline - time.time())))
            except queue.Empty:
                if time.time() < deadline:
                    if any(out[r] is None and r not in errors and not self.procs[r].is_alive()
                           for r in range(self.world)):
                        deadline = min(deadline, time.time() + 20)  # its peers' errors arrive first
                    continue
                stuck = [r for r in range(self.world) if out[r] is None and r not in errors]
                why = self._why(stuck)  # before close(): which ranks died, and their stacks
                self.close()
                first = f"; rank {min(errors)} failed (lowest rank of {sorted(errors)}):\n{errors[min(errors)]}" \
                    if errors else ""
                raise CaseError(f"case {name} got no answer within {time.time() - t_start:.0f} s from ranks "
                                f"{stuck}{first}{why}") from None
            if k != key:
                continue
            got += 1
            if res[0] == "error":
                errors[rank] = res[1]
                deadlock_grace = time.time() + 20  # peers of a failed rank may wait for it forever
                deadline = min(deadline, deadlock_grace)
            else:
                out[rank] = res[1]
        if errors:
            rank = min(errors)
            raise CaseError(f"case {name} failed on rank(s) {sorted(errors)}; rank {rank}:\n{errors[rank]}")
        return out

    def _why(self, ranks: list[int]) -> str:
        """For ranks that gave no answer: dead (with the exit code: negative is the signal) or
        alive, and the end of each one's log (its stacks at a fatal signal or a hang)."""
        parts = []
        for r in ranks:
            p = self.procs[r] if r < len(self.procs) else None
            state = "alive" if p is not None and p.is_alive() else f"dead, exit code {getattr(p, 'exitcode', None)}"
            if p is not None and p.is_alive():  # its stacks now
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(1.0)
                except OSError:
                    pass
            try:
                with open(self.logs[r]) as f:
                    tail = f.read()[-4000:]
            except (OSError, IndexError):
                tail = ""
            parts.append(f"\n--- rank {r} ({state}); its log:\n{tail}")
        return "".join(parts)

    def close(self) -> None:
        for q in getattr(self, "tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
        shutil.rmtree(getattr(self, "_logdir", ""), ignore_errors=True)

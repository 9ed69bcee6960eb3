"""Helpers shared by the tensor-parallel tests."""
from __future__ import annotations

import contextlib
import multiprocessing
import re


def ids(outs):
    return [o["token_ids"] for o in outs]


def gone(pid: int) -> bool:
    """True once pid is no process (or a zombie nobody will reap: not ours)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_killed_headline(exc: BaseException, rank: int, pid: int) -> None:
    """The error's first line names `rank` as the one that died of SIGKILL (the survivors' errors come after)."""
    headline = str(exc).splitlines()[0]
    assert re.fullmatch(rf"tensor-parallel worker rank {rank} \(pid {pid}\) died unexpectedly "
                        rf"\(killed by signal SIGKILL\)", headline), str(exc)[:2000]


def assert_workers_gone(pids):
    live = {p.pid for p in multiprocessing.active_children()}
    assert not live & set(pids), f"worker processes still registered: {live & set(pids)}"
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]


@contextlib.contextmanager
def engine_cache(build):
    """Yields get(name): the engine tuple ``build(name)`` (its second item the TP LLM), built on first use.
    On exit every engine is shut down and none of their worker processes may be left."""
    made: dict = {}

    def get(name):
        if name not in made:
            made[name] = build(name)
        return made[name]

    try:
        yield get
    finally:
        pids = []
        for entry in made.values():
            pids += entry[1].engine.runner.worker_pids
            entry[1].shutdown()
        assert_workers_gone(pids)

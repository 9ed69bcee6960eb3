"""The grammar process: xgrammar's matchers (one per constrained sequence) in a child process of the engine, and
the engine's handle on it (`GrammarProcess`).

Why a process: every step each constrained sequence's matcher accepts its new token and then fills the bitmask of
its next token: ~1 ms for 256 JSON rows on an H200 host (2026-12-01), C++ work during which xgrammar holds the GIL,
so on a thread it could not run beside the engine's Python. In a child process it does. The engine sends the job
as soon as step N's tokens are read, with the rows of step N + 1 (already launched) to fill; it then does N's stop
checks and outputs, schedules and builds step N + 2, and only then collects the masks and samples N + 1
(engine/llm_engine.py `_sample_inflight`).

    engine: GrammarProcess                          child: serve()
    add(sid, kind, text) / drop(sid)   (queued, sent with the next job)
    submit(accepts, fill)  ---- job ---->           new matchers (grammars compiled once per spec), drops,
                                                    accept each (sid, token), fill bitmask row i for fill[i]
                                                    and point its logits row's index entry at it
    collect()              <--- reply ---           (sids whose token broke their grammar, compile errors)

The step's masks are two arrays the sampler takes as they are (nanovllm.kernels.sample): `index`, the bitmask row of
each logits row of the step (-1: unconstrained, or its grammar has ended), and `mask`, the bitmask rows. Both live
in a file both processes map (`torch.from_file(shared=True)`; the child unlinks it once mapped, so nothing is left
behind), page-locked on CUDA (cudaHostRegister) so that their copies to the device are asynchronous, and the engine
does no per-row work for them. The child writes them only between a job and its reply, and the engine submits a
job only after reading the result of the step whose sampler last read them (which waits for that sampling, and so
for the copies before it).
Messages are pickled over the child's stdin and a duplicate of its stdout (stray prints go to stderr); one job is
in flight at a time.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class FillChooser:
    """Which of xgrammar's batch matchers fills a job's masks: one thread, or `threads` of them.

    xgrammar starts its threads at every fill, which costs more than a cheap fill: 256 rows of a JSON array schema
    took 0.13 ms on one thread and 0.25 ms on two with the built-in tokenizer, 0.52 vs 0.67 ms with Qwen3's
    151k-token vocabulary (2-core CPU, 2026-12-01), while a JSON object schema costs ~14 us a row on one core with
    Qwen's tokenizer, where 8 threads win. So one thread fills while its fills would take under `threads_from`
    seconds (exponential average of the seconds per row, times the rows); above that both are timed and the one
    with the lower average fills, the other timed again every `probe_every` fills. `clock` is injectable for tests.
    """

    def __init__(self, xgr, threads: int, threads_from: float = 1e-3, probe_every: int = 64,
                 clock=time.perf_counter):
        self.serial = xgr.BatchGrammarMatcher(1)
        self._modes = [self.serial] + ([xgr.BatchGrammarMatcher(threads)] if threads > 1 else [])
        self._cost: list[float | None] = [None] * len(self._modes)  # seconds per row, averaged
        self.threads_from, self.probe_every, self._clock, self._fills = threads_from, probe_every, clock, 0

    def choice(self, rows: int) -> int:
        """The mode a fill of `rows` matchers uses: 0 = one thread, 1 = several."""
        serial, threaded = self._cost[0], self._cost[-1]
        if len(self._modes) == 1 or serial is None or serial * rows < self.threads_from:
            return 0
        if threaded is None:
            return 1
        best = 0 if serial <= threaded else 1
        return 1 - best if self._fills % self.probe_every == 0 else best

    def fill(self, matchers: list, mask: torch.Tensor, indices: list[int] | None = None) -> None:
        """Fill row indices[i] (default i) of `mask` with matchers[i]'s next-token bitmask."""
        i = self.choice(len(matchers))
        t0 = self._clock()
        self._modes[i].batch_fill_next_token_bitmask(matchers, mask, indices)
        per_row = (self._clock() - t0) / max(len(matchers), 1)
        c = self._cost[i]
        self._cost[i] = per_row if c is None else 0.75 * c + 0.25 * per_row
        self._fills += 1


def _ebnf_literal(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid GBNF string literal (same escapes)


def choice_ebnf(choice: list[str]) -> str:
    """The grammar of a `choice` spec: exactly one of the strings."""
    return "root ::= " + " | ".join(map(_ebnf_literal, choice))


def compile_spec(compiler, kind: str, text: str):
    """One spec (kind, text: engine/structured.spec_key) compiled for the compiler's vocabulary."""
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(text)))
    return compiler.compile_grammar(text)


class _Worker:
    """The child's state: the compiler, compiled grammars (one per spec), matchers by sequence id, the mask."""

    CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first; live matchers keep theirs)

    def __init__(self, init: dict):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.num_tokens = init["num_tokens"]
        rows, words = init["rows"], init["words"]
        _, self.index, self.mask = _views(init["path"], rows, words)
        os.unlink(init["path"])  # both processes have it mapped: nothing to clean up if either dies
        self.fills = FillChooser(xgr, threads=init["threads"])
        self.accepter = self.fills.serial  # accept is serial in xgrammar whatever its thread count
        self.grammars: dict[tuple[str, str], object] = {}
        self.matchers: dict[int, object] = {}

    def _grammar(self, kind: str, text: str):
        key = (kind, text)
        g = self.grammars.pop(key, None)
        if g is None:
            g = compile_spec(self.compiler, kind, text)
            if len(self.grammars) >= self.CACHE_SIZE:
                self.grammars.pop(next(iter(self.grammars)))
        self.grammars[key] = g  # most recently used last
        return g

    def job(self, adds, drops, acc_sids, acc_toks, fill, fill_rows, num_rows) -> tuple[list[int], dict[int, str]]:
        errors = {}
        for sid, kind, text in adds:
            try:
                self.matchers[sid] = self.xgr.GrammarMatcher(self._grammar(kind, text))
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad specs
                errors[sid] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        for sid in drops:
            self.matchers.pop(sid, None)
        # a sid without a matcher (dropped: its sequence finished; or its grammar failed to compile, reported once)
        # has nothing to accept
        live = [i for i, sid in enumerate(acc_sids) if sid in self.matchers]
        broken = []
        if live:
            ok = self.accepter.batch_accept_token([self.matchers[acc_sids[i]] for i in live],
                                                  [acc_toks[i] for i in live])
            broken = [acc_sids[i] for i, a in zip(live, ok) if not a]
        index = [-1] * num_rows
        rows, ms = [], []
        for i, (sid, row) in enumerate(zip(fill, fill_rows)):
            m = self.matchers.get(sid)
            if m is not None and not m.is_terminated():
                rows.append(i)
                ms.append(m)
                index[row] = i
        self.index[:num_rows] = torch.tensor(index, dtype=torch.int32)
        if ms:
            mask = self.mask[:len(fill)]
            self.fills.fill(ms, mask, rows)
            if self.num_tokens % 32:  # xgrammar may leave bits past the vocabulary set (a state allowing "anything")
                mask[:, -1] &= (1 << (self.num_tokens % 32)) - 1
        return broken, errors


def serve(inp, out) -> None:
    """The child's loop: read a message, answer it; ends at "stop" or when the engine's end of the pipe closes."""
    worker = None
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        op = msg[0]
        if op == "init":
            worker = _Worker(msg[1])
            continue
        if op == "stop":
            return
        if op == "job":
            try:
                reply = worker.job(*msg[1:])
            except Exception as e:  # noqa: BLE001 - reported to the engine, whose step raises it
                reply = RuntimeError(f"grammar process: {type(e).__name__}: {e}")
        elif op == "stats":
            reply = {"matchers": len(worker.matchers), "grammars": len(worker.grammars)}
        else:
            reply = RuntimeError(f"grammar process: unknown message {op!r}")
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def _views(path: str, rows: int, words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared file, mapped once: all of it, its (rows,) int32 `index` and its (rows, words) int32 `mask`."""
    flat = torch.from_file(path, shared=True, size=rows * (1 + words), dtype=torch.int32)
    return flat, flat[:rows], flat[rows:].view(rows, words)


class GrammarProcessExited(RuntimeError):
    """The grammar process is gone (killed, or it crashed): its matchers with it."""


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _pin(t: torch.Tensor) -> bool:
    """Page-lock a tensor's host memory for asynchronous copies to the device; False if CUDA refused."""
    try:
        return torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) == 0
    except (RuntimeError, AttributeError):
        return False


def _close(proc: subprocess.Popen, flat: torch.Tensor | None, pinned: bool) -> None:
    if pinned and flat is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
        except (RuntimeError, AttributeError):
            pass
    if proc.poll() is None:
        try:
            pickle.dump(("stop",), proc.stdin)
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            proc.kill()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except (OSError, ValueError):
            pass


class GrammarProcess:
    """The engine's end: starts the child, queues matcher adds / drops, submits jobs and collects their replies.

    rows: the most rows a fill can have (the engine's max_num_seqs). The child starts importing at once; the first
    collect waits for it (~2 s on a 2-core machine)."""

    def __init__(self, tokenizer_info_json: str, num_tokens: int, rows: int, threads: int, pin_memory: bool):
        self.rows, self.words = rows, (num_tokens + 31) // 32
        fd, path = tempfile.mkstemp(prefix="nanovllm-bitmask-", dir=_shm_dir())
        os.ftruncate(fd, rows * (1 + self.words) * 4)
        os.close(fd)
        flat, self.index, self.mask = _views(path, rows, self.words)
        self.pinned = pin_memory and _pin(flat)
        if pin_memory and not self.pinned:
            logger.warning("could not page-lock the grammar bitmask: its copies to the device will not overlap")
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the nanovllm package
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.engine.grammar_worker"], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except BaseException:
            os.unlink(path)
            raise
        self._finalizer = weakref.finalize(self, _close, self.proc, flat, self.pinned)
        self._send(("init", {"tokenizer_info": tokenizer_info_json, "num_tokens": num_tokens, "rows": rows,
                             "words": self.words, "path": path, "threads": threads}))
        self._adds: list[tuple[int, str, str]] = []
        self._drops: list[int] = []
        self.in_flight: tuple | None = None  # the job in flight's fill: (sids, logits rows, the step's rows)

    def _send(self, msg) -> None:
        try:
            pickle.dump(msg, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise self._died() from e

    def _died(self) -> GrammarProcessExited:
        try:
            code = self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        self.in_flight = None
        return GrammarProcessExited(f"the grammar process (structured outputs) exited"
                                    f"{f' with code {code}' if code is not None else ''}")

    def _recv(self):
        try:
            reply = pickle.load(self.proc.stdout)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
            raise self._died() from e
        if isinstance(reply, Exception):
            raise reply
        return reply

    def add(self, sid: int, kind: str, text: str) -> None:
        self._adds.append((sid, kind, text))

    def drop(self, sid: int) -> None:
        self._drops.append(sid)

    def submit(self, acc_sids: list[int], acc_tokens: list[int], fill: list[int], fill_rows: list[int],
               num_rows: int) -> None:
        """Send a job: the queued adds / drops, then matcher acc_sids[i] accepts acc_tokens[i], then for fill[i]
        bitmask row i is filled and index[fill_rows[i]] = i; index[:num_rows] is -1 elsewhere."""
        if self.in_flight is not None:
            raise RuntimeError("a grammar job is already in flight: collect it first")
        if num_rows > self.rows:
            raise ValueError(f"a step of {num_rows} rows: more than the {self.rows} the bitmask holds")
        self._send(("job", self._adds, self._drops, acc_sids, acc_tokens, fill, fill_rows, num_rows))
        self._adds, self._drops = [], []
        self.in_flight = (fill, fill_rows, num_rows)

    def collect(self) -> tuple[list[int], dict[int, str]]:
        """The job's reply: the sids whose token broke their grammar, and compile errors by sid. index[:num_rows]
        and the filled rows of `mask` are valid until the next job."""
        if self.in_flight is None:
            raise RuntimeError("no grammar job in flight")
        self.in_flight = None
        return self._recv()

    def stats(self) -> dict:
        """The child's live matchers and cached grammars (after the queued adds / drops are sent)."""
        self.submit([], [], [], [], 0)
        self.collect()
        self._send(("stats",))
        return self._recv()

    def close(self) -> None:
        self._finalizer()


def _main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (xgrammar, torch) must not corrupt the replies
    serve(inp, out)


if __name__ == "__main__":
    _main()

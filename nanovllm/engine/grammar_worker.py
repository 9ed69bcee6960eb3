"""The grammar process: xgrammar's matchers (one per constrained sequence) in child processes of the engine, and
the engine's handle on them (`GrammarProcess`).

Why processes: every step each constrained sequence's matcher accepts its new token and then fills the bitmask of
its next token. That is C++ work during which xgrammar holds the GIL, so on a thread it could not run beside the
engine's Python; in a child process it does. The accepts are serial inside xgrammar, ~6 us a token for a JSON
schema (256 rows: ~1.6 ms on a 2-core CPU, where the 256 fills took 0.16 ms; 2026-12-02), longer than the host work
they hide behind, so the sequences are split over several children (`workers`, chosen by engine/structured.py from
the CPUs): child r owns the matchers of the seq_ids with seq_id % workers == r. The engine sends the job as soon as
step N's tokens are read, with the rows of step N + 1 (already launched) to fill; it then does N's stop checks and
outputs, schedules and builds step N + 2, and only then collects the masks and samples N + 1
(engine/llm_engine.py `_sample_inflight`).

    engine: GrammarProcess                          each child: serve()
    add(sid, kind, text) / drop(sid)   (queued, sent with the next job)
    submit(accepts, fill)  ---- job ---->           (its own sids) new matchers (grammars compiled once per spec),
                           (to every child)         drops, accept each (sid, token), fill bitmask row i for fill[i]
                                                    and point its logits row's index entry at it
    collect()              <--- replies ---         (sids whose token broke their grammar, compile errors)

The step's masks are two arrays the sampler takes as they are (nanovllm.kernels.sample): `index`, the bitmask row of
each logits row of the step (-1: unconstrained, or its grammar has ended; the engine resets the step's entries to
-1 before each job), and `mask`, the bitmask rows (fill i -> row i: the children's rows never overlap). Both live in
a file every process maps (`torch.from_file(shared=True)`; the engine unlinks it once every child has answered that
it has mapped it, so nothing is left behind), page-locked on CUDA (cudaHostRegister) so that their copies to the
device are asynchronous, and the engine does no per-row work for them. The children write them only between a job
and its reply, and the engine submits a job only after reading the result of the step whose sampler last read
them (which waits for that sampling, and so for the copies before it).
Messages are pickled over each child's stdin and a duplicate of its stdout (stray prints go to stderr); one job is
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
        self.rank, self.workers = init["rank"], init["workers"]
        rows, words = init["rows"], init["words"]
        _, self.index, self.mask = _views(init["path"], rows, words)  # (the engine unlinks it once all have it)
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

    def job(self, adds, drops, acc_sids, acc_toks, fill, fill_rows) -> tuple[list[int], dict[int, str]]:
        """The whole step's job, of which this worker does its own sequences' part (seq_id % workers == rank):
        new matchers, drops, accepts, and bitmask row i for fill[i], with index[fill_rows[i]] = i (the engine has
        set the step's index to -1)."""
        mine, K, r = self.matchers, self.workers, self.rank
        errors = {}
        for sid, kind, text in adds:
            if sid % K != r:
                continue
            try:
                mine[sid] = self.xgr.GrammarMatcher(self._grammar(kind, text))
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad specs
                errors[sid] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        for sid in drops:
            mine.pop(sid, None)
        # a sid without a matcher here (another worker's; dropped: its sequence finished; or its grammar failed to
        # compile, reported once) has nothing to accept
        live = [i for i, sid in enumerate(acc_sids) if sid in mine]
        broken = []
        if live:
            ok = self.accepter.batch_accept_token([mine[acc_sids[i]] for i in live], [acc_toks[i] for i in live])
            broken = [acc_sids[i] for i, a in zip(live, ok) if not a]
        rows, logits_rows, ms = [], [], []
        for i, (sid, row) in enumerate(zip(fill, fill_rows)):
            m = mine.get(sid)
            if m is not None and not m.is_terminated():
                rows.append(i)
                logits_rows.append(row)
                ms.append(m)
        if ms:
            filled = torch.tensor(rows, dtype=torch.int32)
            self.index[torch.tensor(logits_rows)] = filled
            self.fills.fill(ms, self.mask, rows)
            if self.num_tokens % 32:  # xgrammar may leave bits past the vocabulary set (a state allowing "anything")
                self.mask[filled.long(), -1] &= (1 << (self.num_tokens % 32)) - 1
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
        if op == "stop":
            return
        if op == "init":  # answered once the shared file is mapped: the engine then unlinks it
            worker = _Worker(msg[1])
            reply = "ready"
        elif op == "job":
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


def _close(procs: list[subprocess.Popen], flat: torch.Tensor | None, pinned: bool, path: list[str]) -> None:
    if pinned and flat is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
        except (RuntimeError, AttributeError):
            pass
    for proc in procs:
        if proc.poll() is None:
            try:
                pickle.dump(("stop",), proc.stdin)
                proc.stdin.close()
            except (OSError, ValueError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except (OSError, ValueError):
                pass
    _unlink(path)


def _unlink(path: list[str]) -> None:
    """Remove the shared file, once (``path``: a one-item list, emptied)."""
    while path:
        try:
            os.unlink(path.pop())
        except FileNotFoundError:
            pass


class GrammarProcess:
    """The engine's end: starts the children, queues matcher adds / drops, submits jobs and collects their replies.

    rows: the most rows a fill can have (the engine's max_num_seqs). workers: child processes; each owns the
    matchers of the sequences whose seq_id % workers is its rank, so a step's accepts (serial inside xgrammar, ~6 us
    a token) and fills split over them. Every job goes to every child; each does its own sequences' part. The
    children start importing at once; the first collect waits for them (~2 s on a 2-core machine), and the shared
    file is unlinked once every child has mapped it."""

    def __init__(self, tokenizer_info_json: str, num_tokens: int, rows: int, threads: int, pin_memory: bool,
                 workers: int = 1):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"the grammar process needs workers >= 1, got {workers!r}")
        self.rows, self.words = rows, (num_tokens + 31) // 32
        fd, path = tempfile.mkstemp(prefix="nanovllm-bitmask-", dir=_shm_dir())
        os.ftruncate(fd, rows * (1 + self.words) * 4)
        os.close(fd)
        self._path = [path]
        flat, self.index, self.mask = _views(path, rows, self.words)
        self.pinned = pin_memory and _pin(flat)
        if pin_memory and not self.pinned:
            logger.warning("could not page-lock the grammar bitmask: its copies to the device will not overlap")
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the nanovllm package
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _close, self.procs, flat, self.pinned, self._path)
        try:
            for _ in range(workers):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "nanovllm.engine.grammar_worker"], env=env,
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        except BaseException:
            self._finalizer()
            raise
        self._unready = list(self.procs)  # children whose "ready" (file mapped) has not been read
        for rank, proc in enumerate(self.procs):
            self._send(("init", {"tokenizer_info": tokenizer_info_json, "num_tokens": num_tokens, "rows": rows,
                                 "words": self.words, "path": path, "threads": threads, "rank": rank,
                                 "workers": workers}), [proc])
        self._adds: list[tuple[int, str, str]] = []
        self._drops: list[int] = []
        self.in_flight: tuple | None = None  # the job in flight's fill: (sids, logits rows, the step's rows)

    def _send(self, msg, procs: list[subprocess.Popen] | None = None) -> None:
        """`msg` to `procs` (default: every child), pickled once."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for proc in self.procs if procs is None else procs:
                proc.stdin.write(data)
                proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise self._died() from e

    def _died(self) -> GrammarProcessExited:
        deadline = time.monotonic() + 1
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        self.in_flight = None
        code = next((c for c in codes if c), None)
        return GrammarProcessExited(f"the grammar process (structured outputs) exited"
                                    f"{f' with code {code}' if code is not None else ''}")

    def _recv(self, proc: subprocess.Popen):
        if self._unready:  # first the children's "ready"; then nobody needs the file's name
            for p in self._unready:
                self._read(p)
            self._unready = []
            _unlink(self._path)
        return self._read(proc)

    def _read(self, proc: subprocess.Popen):
        try:
            reply = pickle.load(proc.stdout)
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
        # (the last reader of the index, the step before's sampler, is done: see the module docstring)
        self.index[:num_rows] = -1
        self._send(("job", self._adds, self._drops, acc_sids, acc_tokens, fill, fill_rows))
        self._adds, self._drops = [], []
        self.in_flight = (fill, fill_rows, num_rows)

    def collect(self) -> tuple[list[int], dict[int, str]]:
        """The job's reply: the sids whose token broke their grammar, and compile errors by sid. index[:num_rows]
        and the filled rows of `mask` are valid until the next job."""
        if self.in_flight is None:
            raise RuntimeError("no grammar job in flight")
        self.in_flight = None
        broken, errors = [], {}
        for proc in self.procs:
            b, e = self._recv(proc)
            broken += b
            errors.update(e)
        return broken, errors

    def stats(self) -> dict:
        """The children's live matchers and cached grammars, summed (after the queued adds / drops are sent)."""
        self.submit([], [], [], [], 0)
        self.collect()
        self._send(("stats",))
        replies = [self._recv(proc) for proc in self.procs]
        return {k: sum(r[k] for r in replies) for k in ("matchers", "grammars")}

    def close(self) -> None:
        self._finalizer()


def _main() -> None:
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (xgrammar, torch) must not corrupt the replies
    serve(inp, out)


if __name__ == "__main__":
    _main()

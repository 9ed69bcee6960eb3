"""Multi-node tensor parallelism on one host (CPU, gloo): two "nodes" as two process trees on 127.0.0.1.

Node 0 is this test process (LLM with tensor_parallel_size=2, nnodes=2: the driver and rank 0's worker); node 1
is `python -m nanovllm serve MODEL --headless --node-rank 1 ...` in a session of its own (rank 1's worker under
it), which gets every step from rank 0 through torch.distributed. Greedy tokens equal TP=1's; a node killed or
frozen mid-run is an error naming it on the leader within seconds; a missing node or a node configured differently
is a clear error at start. The environment's node values (LeaderWorkerSet, torchrun) are checked without processes.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.nodes import node_kwargs_from_env
from tests.conftest import make_prompts
from tests.distributed.tp_helpers import assert_workers_gone, ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=48,
                 max_num_seqs=8)
HEARTBEAT_TIMEOUT = 3.0
NODE_ENV = ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS", "WORLD_SIZE", "RANK", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(kw: dict) -> list[str]:
    return [a for k, v in kw.items() for a in ("--" + k.replace("_", "-"), str(v))]


def start_node1(path: str, port: int, **overrides) -> subprocess.Popen:
    """Node 1: `nanovllm serve --headless` in its own session (its process group holds its worker too)."""
    env = {k: v for k, v in os.environ.items() if k not in NODE_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "nanovllm", "serve", path, "--headless", "--tensor-parallel-size", "2", "--nnodes",
           "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           *_flags({**ENGINE_KW, **overrides})]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def leader(path: str, port: int) -> LLM:
    return LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
               **ENGINE_KW)


def _worker_of(pid: int) -> int:
    """The pid of the rank process under node process `pid` (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = f.read().split()
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return int(child)
    raise AssertionError(f"no rank process under {pid}: {children}")


def _kill_tree(node: subprocess.Popen) -> None:
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.wait(10)


@pytest.fixture
def cluster(tiny_ckpt, monkeypatch):
    """(path, leader LLM, node 1's process); everything stopped afterwards. The leader calls a node dead after
    HEARTBEAT_TIMEOUT seconds without a heartbeat (beats come every 0.5 s)."""
    monkeypatch.setenv("NANOVLLM_TP_HEARTBEAT_TIMEOUT", str(HEARTBEAT_TIMEOUT))
    path = tiny_ckpt("qwen3")
    port = _free_port()
    node = start_node1(path, port)
    llm = None
    try:
        llm = leader(path, port)
        yield path, llm, node
    finally:
        if llm is not None:
            pids = llm.engine.runner.worker_pids
            llm.shutdown()
            assert_workers_gone(pids)
        if node.poll() is None:
            try:
                node.wait(15)
            finally:
                _kill_tree(node)


def test_two_nodes_match_tp1_and_shut_down_cleanly(cluster):
    path, llm, node = cluster
    prompts = make_prompts((1, 5, 17, 40), 0, high=480)
    out = llm.generate(prompts, GREEDY, use_tqdm=False)
    ref = LLM(path, tensor_parallel_size=1, **ENGINE_KW).generate(prompts, GREEDY, use_tqdm=False)
    assert ids(out) == ids(ref)
    assert all(len(o["token_ids"]) == 8 for o in out)
    assert len(llm.engine.runner.worker_pids) == 1  # only rank 0 runs here
    llm.shutdown()  # the ShutdownMsg reaches rank 1 through rank 0's broadcast: node 1 exits by itself, status 0
    assert node.wait(15) == 0, node.stdout.read()


@pytest.mark.parametrize("fault", ["kill", "freeze", "kill-rank"])
def test_lost_node_fails_the_leader_naming_it(cluster, fault):
    """kill: node 1's whole process tree is SIGKILLed (its sockets close: the step's collective fails at once).
    freeze: it is SIGSTOPped (sockets open, no heartbeat: a host that hangs); the leader's step fails once the
    heartbeat timeout is up, never waiting for the collective's own timeout. kill-rank: only node 1's rank dies;
    node 1 reports it (and exits 1), and the leader's error says which rank on which node."""
    _, llm, node = cluster
    prompts = make_prompts((6, 3), 1, high=480)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"long-{i}", p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    llm.engine.step()
    if fault == "kill-rank":
        rank1 = _worker_of(node.pid)
        os.kill(rank1, signal.SIGKILL)
    else:
        os.killpg(node.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as info:
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        elapsed = time.monotonic() - t0
        if fault == "kill-rank":
            assert node.wait(10) == 1
    finally:
        _kill_tree(node)
    headline = str(info.value).splitlines()[0]
    if fault == "kill-rank":
        assert headline == (f"tensor-parallel worker rank 1 (pid {rank1}) on node 1 (rank 1) died unexpectedly "
                            f"(killed by signal SIGKILL)"), str(info.value)[:2000]
        assert "died unexpectedly (killed by signal SIGKILL)" in node.stdout.read()
    else:
        assert headline.startswith("node 1 (rank 1) stopped sending heartbeats"), str(info.value)[:2000]
    # kill: rank 0's collective fails at once, then the heartbeat verdict (BLAME_WINDOW_S, 2 s); kill-rank: node
    # 1's report comes within that window; freeze: the heartbeat timeout, then the failure grace (1 s). Room for a
    # loaded 2-core machine either way.
    assert elapsed < (HEARTBEAT_TIMEOUT + 5 if fault == "freeze" else 6), elapsed
    assert not llm.engine.runner.is_alive


LEADER_SCRIPT = """
import sys, time
from tests.distributed.test_multinode import leader
llm = leader(sys.argv[1], int(sys.argv[2]))
print("ready", flush=True)
time.sleep(120)
"""


def test_killed_leader_stops_the_other_node(tiny_ckpt):
    """The leader's whole process tree SIGKILLed while idle: node 1 exits with status 1 within seconds, saying so."""
    path = tiny_ckpt("qwen3")
    port = _free_port()
    node = start_node1(path, port)
    env = {k: v for k, v in os.environ.items() if k not in NODE_ENV}
    lead = subprocess.Popen([sys.executable, "-c", LEADER_SCRIPT, path, str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert lead.stdout.readline() == "ready\n"
        os.killpg(lead.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert node.wait(15) == 1
        assert time.monotonic() - t0 < 5
        out = node.stdout.read()
        # whichever it sees first: the step broadcast failing under rank 1, or the leader's store gone
        assert re.search(r"nanovllm serve --headless: (tensor-parallel worker rank 1 \(pid \d+\) on node 1 \(rank 1\) "
                         r"lost its connection to the other ranks|node 1 \(rank 1\) lost the leader: its rendezvous "
                         r"at 127.0.0.1:\d+ stopped answering)", out), out
    finally:
        _kill_tree(lead)
        _kill_tree(node)


def test_missing_node_is_an_error_at_start(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_INIT_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"node 1 \(rank 1\) did not join within \d+s: start `nanovllm serve MODEL "
                                         r"--headless --tensor-parallel-size 2 --nnodes 2 --node-rank 1"):
        leader(tiny_ckpt("qwen3"), _free_port())
    assert time.monotonic() - t0 < 10


def test_node_with_other_engine_arguments_is_refused(tiny_ckpt):
    path = tiny_ckpt("qwen3")
    port = _free_port()
    node = start_node1(path, port, max_num_seqs=4)
    try:
        with pytest.raises(ValueError, match=r"node 1 \(rank 1\) could not start: ValueError: .*engine arguments "
                                             r"differ from the leader's: max_num_seqs: 4 here, 8 on the leader"):
            leader(path, port)
        assert node.wait(15) == 2  # a configuration error on node 1 too
        assert "max_num_seqs: 4 here, 8 on the leader" in node.stdout.read()
    finally:
        _kill_tree(node)


def test_headless_node_without_a_leader_gives_up(tiny_ckpt):
    env = {k: v for k, v in os.environ.items() if k not in NODE_ENV}
    env.update(PYTHONPATH=ROOT, NANOVLLM_TP_INIT_TIMEOUT="1")
    out = subprocess.run([sys.executable, "-m", "nanovllm", "serve", tiny_ckpt("qwen3"), "--headless",
                          "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                          "127.0.0.1", "--master-port", str(_free_port()), "--device", "cpu"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "could not reach the leader's rendezvous at 127.0.0.1:" in out.stderr


# --- node arguments from flags and the environment (no processes) -------------------------------------------------

def _engine_kwargs(argv: list[str], env: dict) -> dict:
    from nanovllm.cli import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(argv), env)


def test_lws_and_torchrun_environment_fill_what_the_flags_leave():
    lws = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "leader.svc", "MASTER_PORT": "1234"}
    assert node_kwargs_from_env({}, lws) == {"nnodes": 2, "node_rank": 1, "master_addr": "leader.svc",
                                             "master_port": 1234}
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500"}
    assert node_kwargs_from_env({}, torchrun) == {"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.1",
                                                  "master_port": 29500}
    # LWS before torchrun's names; flags before both
    assert node_kwargs_from_env({}, {**torchrun, **lws})["node_rank"] == 1
    kw = _engine_kwargs(["--tensor-parallel-size", "4", "--node-rank", "0", "--master-port", "999"], lws)
    assert (kw["nnodes"], kw["node_rank"], kw["master_addr"], kw["master_port"]) == (2, 0, "leader.svc", 999)
    assert _engine_kwargs([], {}) == {}


@pytest.mark.parametrize("argv, env, match", [
    (["--tensor-parallel-size", "2"], {"LWS_GROUP_SIZE": "3"},
     r"tensor_parallel_size=2 is not divisible by nnodes=3.*nnodes=3 from \$LWS_GROUP_SIZE"),
    (["--tensor-parallel-size", "2", "--nnodes", "2"], {"RANK": "2"},
     r"node_rank must be in 0..nnodes-1 = 0..1, got 2 \(node_rank=2 from \$RANK\)"),
    (["--tensor-parallel-size", "2"], {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"},
     r"node_rank=1 needs master_addr"),
    ([], {"LWS_GROUP_SIZE": "two"}, r"\$LWS_GROUP_SIZE='two' \(for nnodes\) is not an integer"),
    ([], {"LOCAL_RANK": "1"}, r"\$LOCAL_RANK=1: run one nanovllm process per node \(torchrun --nproc-per-node 1\)"),
    (["--nnodes", "2", "--tensor-parallel-size", "2", "--master-port", "70000"], {}, r"master_port must be in"),
])
def test_bad_node_values_name_their_source(argv, env, match):
    from nanovllm.config import EngineArgs
    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs("m", **_engine_kwargs(argv, env))

"""Command line: `nanovllm generate ...` (and `nanovllm serve ...` when the server extra is installed)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from nanovllm.config import EngineArgs

_HELP = {
    "device": "'auto', 'cpu' or 'cuda'",
    "dtype": "'auto', 'float32', 'bfloat16' or 'float16'",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "kvcache_block_size": "tokens per KV block (a multiple of 16)",
    "num_kvcache_blocks": "KV blocks to allocate (default: sized from memory)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "enforce_eager": "no CUDA graphs",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "load_format": "'auto' (safetensors) or 'dummy' (random weights)",
    "tensor_parallel_size": "GPUs (or CPU processes) to shard the model over",
    "seed": "engine seed for unseeded sampling",
    "attention_backend": "'auto', 'torch' or 'triton'",
    "async_scheduling": "schedule step N+1 while step N runs (default: on with CUDA)",
    "scheduling_policy": "fcfs: prefill as early as the token budget allows; balanced: spread the prefill of a "
                         "batch known up front over the run (see engine/scheduler.py); auto (default): balanced "
                         "from 6 GiB of weights on one GPU (12 GiB per GPU under TP), else fcfs (the server "
                         "defaults to fcfs)",
    "tokenizer": "tokenizer directory or Hugging Face id (default: the model's)",
    "revision": "revision (branch, tag or commit) of a Hugging Face model id",
    "tokenizer_revision": "revision of a Hugging Face tokenizer id",
    "download_dir": "Hugging Face cache directory (default: huggingface_hub's, e.g. ~/.cache/huggingface/hub)",
    "trust_remote_code": "accepted for vLLM compatibility; no remote code ever runs",
    "quantization": "'fp8': quantize the decoder's projections to FP8 (e4m3) at load time, one scale per output "
                    "channel, activations per token (default: none, or the checkpoint's own quantization_config: "
                    "block-FP8 checkpoints such as Qwen3-*-FP8 load as they are)",
    "kv_cache_dtype": "'auto' (default: the model dtype) or 'fp8' / 'fp8_e4m3': e4m3 K/V with a float32 scale per "
                      "token and KV head (about 1.9x the tokens per GiB)",
    "nnodes": "nodes the tensor-parallel ranks are spread over, tensor_parallel_size / nnodes each (default: "
              "$LWS_GROUP_SIZE, else $WORLD_SIZE under torchrun --nproc-per-node 1, else 1)",
    "node_rank": "this node's index, 0 = the leader (API server, scheduler); others run --headless (default: "
                 "$LWS_WORKER_INDEX, else $RANK, else 0)",
    "master_addr": "the leader's address, where the other nodes join (default: $LWS_LEADER_ADDRESS, else "
                   "$MASTER_ADDR)",
    "master_port": "the leader's rendezvous port (default: $MASTER_PORT, else 29501)",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (default: none)",
    "kv_events_config": "KV-cache events for prefix-aware routers (vLLM's), as JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"topic\": \"kv-events\"}' (default: none; docs/scale-out.md)",
}


def json_object(text: str) -> dict:
    """A flag's JSON object value (argparse type): anything else is an error naming the flag's value."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default (flags whose default is "not given" say theirs in their text)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One --flag per EngineArgs field, vLLM style (--max-model-len, --no-enable-prefix-caching...)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        text = _HELP.get(f.name, "")
        if default is not None and "default" not in text:
            text += f" (default: {default})"
        if isinstance(default, bool) or "bool" in str(f.type):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            typ = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_model_len", "max_num_batched_tokens", "num_kvcache_blocks", "nnodes", "node_rank",
                          "master_port"):
                typ = int
            if str(f.type).startswith("dict"):
                typ = json_object
            group.add_argument(flag, type=typ, default=None, help=text)


def engine_kwargs(ns: argparse.Namespace, env=None) -> dict:
    """The engine arguments the user actually gave (others keep EngineArgs' defaults), the node arguments not given
    filled from the environment (LeaderWorkerSet's, torchrun's: distributed/nodes.py). A bad node value is a
    ValueError that says which variable it came from."""
    from nanovllm.distributed.nodes import ENV_SOURCES, env_source, node_kwargs_from_env, validate_node_args
    env = os.environ if env is None else env
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
             if f.name != "model" and getattr(ns, f.name, None) is not None}
    kwargs = {**given, **node_kwargs_from_env(given, env)}
    from_env = [f"{n}={kwargs[n]!r} from {env_source(n, given, env)}" for n in ENV_SOURCES
                if n in kwargs and n not in given]
    if from_env:
        try:
            validate_node_args(kwargs.get("tensor_parallel_size", 1), *(kwargs.get(n) for n in ENV_SOURCES))
        except (ValueError, TypeError) as e:
            raise type(e)(f"{e} ({', '.join(from_env)})") from None
    return kwargs


def default_model(model: str | None) -> str:
    """The model to load: the one given, else the built-in tiny model (random weights, said so on stderr)."""
    if model is not None:
        return model
    from nanovllm.utils.tiny_model import ensure_default_tiny_model
    try:
        model = ensure_default_tiny_model()
    except OSError as e:  # an unusable NANOVLLM_TINY_MODEL_DIR (or cache directory)
        raise ValueError(f"could not write the built-in tiny model: {e}") from None
    print(f"[nanovllm] no model given: using a built-in tiny model with RANDOM weights at {model}\n"
          f"[nanovllm] its output is gibberish by design; pass a checkpoint directory or a Hugging Face id",
          file=sys.stderr)
    return model


def check_engine_args(model: str | None, kwargs: dict) -> None:
    """Engine flags checked against this machine before any model is loaded or downloaded (ValueError/TypeError)."""
    from nanovllm.config import resolve_device
    resolve_device(EngineArgs.from_kwargs(model or ".", **kwargs))


def _generate(ns: argparse.Namespace) -> int:
    from nanovllm import LLM, SamplingParams
    params = SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                            max_tokens=ns.max_tokens, seed=ns.sampling_seed, ignore_eos=ns.ignore_eos,
                            stop=ns.stop or None, logprobs=ns.logprobs)
    kwargs = engine_kwargs(ns)
    check_engine_args(ns.model, kwargs)
    model = default_model(ns.model)
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    print(f"[nanovllm] engine ready in {time.perf_counter() - t0:.1f}s "
          f"(device={llm.engine.config.device}, dtype={llm.engine.config.dtype}, "
          f"kv blocks={llm.engine.block_manager.num_blocks})", file=sys.stderr)
    prompts = ns.prompt or ["Hello, Nano-vLLM.", "The capital of France is"]
    t0 = time.perf_counter()
    try:
        if ns.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not ns.quiet)
        else:
            outs = llm.generate(prompts, params, use_tqdm=not ns.quiet)
    finally:
        llm.shutdown()
    seconds = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"\nPrompt: {p!r}")
        for c in o.outputs:
            label = "Output" if len(o.outputs) == 1 else f"Output {c.index}"
            print(f"{label}: {c.text!r}\n  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}"
                  + (f", cumulative_logprob={c.cumulative_logprob:.3f}" if c.cumulative_logprob is not None else "")
                  + ")")
            if c.logprobs is not None:
                for tok, pos in zip(c.token_ids, c.logprobs):
                    top = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.2f}" for lp in
                                    sorted(pos.values(), key=lambda lp: lp.rank))
                    print(f"    {pos[tok].decoded_token!r} rank {pos[tok].rank}: {top}")
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    spec = llm.engine.spec_metrics
    print(f"[nanovllm] {len(outs)} requests, {tokens} tokens in {seconds:.2f}s, "
          f"{tokens / max(seconds, 1e-9):.1f} tok/s"
          + (f", {spec['num_accepted_tokens']}/{spec['num_draft_tokens']} draft tokens accepted (mean acceptance "
             f"length {spec['mean_acceptance_length']:.2f})" if spec else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="Nano-vLLM: a small, fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline for one or more prompts", formatter_class=HelpFormatter)
    g.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face id (default: a built-in tiny model, random weights)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per sample at most")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the most likely")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="print each token's logprob and this many top ones")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    g.add_argument("--stop", action="append", help="stop string (repeat for several)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    try:
        from nanovllm.server.cli import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, TypeError) as e:
        print(f"nanovllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

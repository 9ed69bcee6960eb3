"""vLLM's offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
import time

from nanovllm.beam_search import BeamSearchOutput, beam_search
from nanovllm.config import EngineArgs
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.output import request_output
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


def _normalize_prompts(prompts) -> list:
    """str | list[str] | list[list[int]] | list[int] (one tokenized prompt) | dicts -> list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    out = []
    for p in prompts:
        if isinstance(p, dict):
            extra = [k for k in p if k not in ("prompt", "prompt_token_ids")]
            if extra:  # vLLM's multi_modal_data, cache_salt, ...: not silently dropped
                raise ValueError(f"prompt dict keys {extra} are not supported (only 'prompt' or 'prompt_token_ids')")
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
                if not isinstance(p, (list, tuple)):
                    raise TypeError(f"prompt_token_ids must be a list of ints, got {type(p).__name__} {p!r}")
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {list(p)}")
        out.append(p)
    return out


class LLM:
    """Offline batched generation.

    >>> llm = LLM("Qwen/Qwen3-0.6B")          # a local directory, or a Hugging Face model id
    >>> llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))[0].outputs[0].text
    """

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **engine_args))
        self._request_ids = itertools.count()
        self._token_text: dict[int, str] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order (its `n` samples in
        `outputs`). nano-vllm's `out["text"]`, `out["token_ids"]`, ... read the first sample.

        Every prompt and parameter set is validated before any request is queued: a bad one raises
        ValueError/TypeError and leaves the engine as it was."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        valid = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                valid.append(self.engine.validate_request(p, sp))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        ids = [f"gen-{next(self._request_ids)}" for _ in valid]
        for rid, req in zip(ids, valid):
            self.engine.add_request(rid, req)
        try:
            results = self._run(set(ids), use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        texts = [p if isinstance(p, str) else None for p in prompts]
        return [request_output(rid, text, results[rid], self._decode_token) for rid, text in zip(ids, texts)]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best continuations of each prompt by beam search
        (``nanovllm.beam_search``), one `BeamSearchOutput` per prompt. Prompts as `generate` takes them; every
        prompt must leave room for `params.max_tokens` tokens within max_model_len (else a ValueError, before any
        step runs)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        L = self.engine.config.max_model_len
        ids = []
        for i, p in enumerate(_normalize_prompts(prompts)):
            try:
                tokens = self.engine.validate_request(p, None).prompt_token_ids
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            if len(tokens) + params.max_tokens > L:
                raise ValueError(f"prompt {i}: {len(tokens)} prompt tokens + max_tokens={params.max_tokens} exceed "
                                 f"max_model_len={L}")
            ids.append(tokens)
        tok = self.engine.tokenizer
        return beam_search(lambda ps, sp: self.generate(ps, sp, use_tqdm=False), ids, params,
                           self.engine.eos_token_ids, tok.decode if tok is not None else None, use_tqdm)

    def _decode_token(self, tid: int) -> str | None:
        tok = self.engine.tokenizer
        if tok is None:
            return None
        s = self._token_text.get(tid)
        if s is None:
            s = self._token_text[tid] = tok.decode([tid])
        return s

    def _run(self, pending: set[str], use_tqdm: bool) -> dict:
        """Step until every pending request has finished: request id -> its samples' final StepOutputs."""
        results: dict[str, list] = {}
        left = {rid: len(self.engine.requests[rid]) for rid in pending}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(pending), desc="Processed prompts", dynamic_ncols=True)
        prefill_tps = decode_tps = 0.0
        try:
            while pending:
                t = time.perf_counter()
                outputs, n_prefill, n_decode = self.engine.step()
                dt = max(time.perf_counter() - t, 1e-9)
                if n_prefill:
                    prefill_tps = n_prefill / dt
                elif n_decode:
                    decode_tps = n_decode / dt
                for out in outputs:
                    if out.finished and out.request_id in pending:
                        results.setdefault(out.request_id, []).append(out)
                        left[out.request_id] -= 1
                        if not left[out.request_id]:
                            pending.discard(out.request_id)
                            if bar is not None:
                                bar.update(1)
                if bar is not None:
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
        finally:
            if bar is not None:
                bar.close()
        return results

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """A conversation as prompt token ids, through the tokenizer's chat template."""
        if not isinstance(conversation, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
            raise ValueError("a conversation must be a list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(conversation):
            if not isinstance(m["role"], str):
                raise TypeError(f"message {i}: role must be a string, got {m['role']!r}")
            if not isinstance(m["content"], (str, list)):
                raise TypeError(f"message {i}: content must be a string or a list of parts, got "
                                f"{type(m['content']).__name__} {m['content']!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        text = tok.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt,
                                       **(chat_template_kwargs or {}))
        return tok.encode(text, add_special_tokens=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (no request may be running); False if some blocks are still held."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

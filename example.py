"""Offline generation in a few lines (runs on CPU with the built-in tiny random model if no path is given).

    python example.py [MODEL_DIR]
"""
import sys

from nanovllm import LLM, SamplingParams


def main():
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from nanovllm.utils.tiny_model import ensure_default_tiny_model
        path = ensure_default_tiny_model()
        print(f"(no model given: using a tiny model with RANDOM weights at {path}; expect gibberish)")
    llm = LLM(path, enforce_eager=True)
    params = SamplingParams(temperature=0.6, max_tokens=64)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    if llm.tokenizer.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}\nCompletion: {out['text']!r}")


if __name__ == "__main__":
    main()

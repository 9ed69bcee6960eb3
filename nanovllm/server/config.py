"""The server's own options (`nanovllm serve` flags beside the engine's), validated on construction."""
from __future__ import annotations

from dataclasses import dataclass


def check_data_parallel_size(size) -> int:
    """`size` if it is an int >= 1: TypeError for another type (a bool too), ValueError below 1."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise TypeError(f"data_parallel_size must be an int >= 1, got {type(size).__name__} {size!r}")
    if size < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {size}")
    return size


@dataclass(frozen=True)
class ServerConfig:
    """served_model_names: names clients may use in `model` (empty: the model directory).
    api_key: require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (None: open).
    max_request_body_bytes: a larger body is answered 413 before it is read (10 MiB: a 128k-token prompt as text
        or as token ids fits several times over).
    trust_request_chat_template: let clients send their own Jinja chat template (`chat_template`, or
        `chat_template_kwargs.chat_template`); otherwise such a request is a 400. vLLM's flag.
    chat_template_timeout: seconds a chat template may take to render (the request is a 400 past it).
    engine_step_timeout: seconds without any step finishing, while requests are in flight, after which the engine
        counts as stalled: its process is killed, the requests fail, the server exits non-zero (the watchdog).
    graceful_shutdown_timeout: on SIGTERM/SIGINT, seconds that requests in flight get to finish before they are
        ended with an error.
    data_parallel_size: engine cores behind the server, each with its own tensor-parallel group; requests go to
        the least-loaded one, with prefix affinity (server/dp_client.py). vLLM's flag.
    """
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_request_body_bytes: int = 10 << 20
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 5.0
    engine_step_timeout: float = 60.0
    graceful_shutdown_timeout: float = 20.0
    data_parallel_size: int = 1

    def __post_init__(self):
        if not isinstance(self.served_model_names, tuple) or \
                not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError(f"served_model_names must be a tuple of non-empty strings, "
                             f"got {self.served_model_names!r}")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        n = self.max_request_body_bytes
        if not isinstance(n, int) or isinstance(n, bool) or n < 1024:
            raise ValueError(f"max_request_body_bytes must be an int >= 1024, got {n!r}")
        if not isinstance(self.trust_request_chat_template, bool):
            raise TypeError(f"trust_request_chat_template must be a bool, got {self.trust_request_chat_template!r}")
        check_data_parallel_size(self.data_parallel_size)
        for name in ("chat_template_timeout", "engine_step_timeout", "graceful_shutdown_timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")

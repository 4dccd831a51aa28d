"""Server settings in one place: each field has a CLI flag and a ``PLUGSERVE_*`` env variable.

Precedence: command-line flag, then environment variable, then the default here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from plugserve.plugins.api import available_cores
from plugserve.server.process.tracing import TraceConfig

__all__ = ["Settings"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_CONTROL_MODES = ("", "none", "explicit", "poll")
_LOG_FORMATS = ("text", "json")


def _field(
    default: Any,
    help: str,
    flag: str | None = None,
    repeat: bool = False,
    low: float | None = None,
    high: float | None = None,
) -> Any:
    """``repeat``: the flag may be given several times; the values are joined with commas."""
    return dataclasses.field(
        default=default,
        metadata={"help": help, "flag": flag, "repeat": repeat, "low": low, "high": high},
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    host: str = _field("0.0.0.0", "address to listen on")
    grpc_port: int = _field(
        8001,
        "gRPC port (plugserve.v1, KServe v2, health, reflection); 0: any free port",
        low=0,
        high=65535,
    )
    http_port: int = _field(
        8000,
        "KServe v2 REST port (health, metadata, infer with JSON or binary tensors, repository); "
        "0: any free port, -1: off",
        low=-1,
        high=65535,
    )
    metrics_port: int = _field(
        8002, "Prometheus /metrics port; 0: any free port, -1: off", low=-1, high=65535
    )
    metrics_interval_ms: int = _field(
        2000,
        "how often the per-GPU metrics (nv_gpu_*, NVML) are sampled, in ms (Triton's flag)",
        low=50,
        high=3_600_000,
    )
    gpu_metrics: int = _field(
        1,
        "1: per-GPU metrics (nv_gpu_* labelled gpu_uuid, as Triton's) where NVML is present "
        "(pip install plugserve[gpu]); 0: none (Triton's --allow-gpu-metrics)",
    )
    health_port: int = _field(
        -1,
        "a plaintext port serving only the gRPC health service, for probes that cannot speak "
        "TLS to --grpc-port (Kubernetes' grpc probes); -1: off, 0: any free port",
        low=-1,
        high=65535,
    )
    model_repository: str = _field(
        "", "model repository DIR/<name>/<version>/model.onnx; empty: the bundled examples"
    )
    model_name: str = _field(
        "",
        "serve --model-repository as this one model when it is a single .onnx file or a folder "
        "holding one (KServe's storage layout); a repository layout is served as it is",
    )
    model_control_mode: str = _field(
        "",
        "as Triton: none (load every model at startup; load/unload requests refused), explicit "
        "(load only --load-model at startup; load/unload by request), poll (load every model, "
        "then follow the repository's changes every --repository-poll-secs; load/unload "
        "requests refused); empty: load every model at startup and allow load/unload",
    )
    load_model: str = _field(
        "",
        "with --model-control-mode explicit: a model to load at startup (repeat the flag or "
        "separate by commas; '*': every model)",
        repeat=True,
    )
    repository_poll_secs: float = _field(
        15.0,
        "with --model-control-mode poll: seconds between two looks at the repository",
        low=0.1,
    )
    model_load_threads: int = _field(
        0,
        "models loaded at once when the server starts and when --model-control-mode poll finds "
        "new or changed versions (as Triton's --model-load-thread-count); 1: one after "
        "another; 0: as many as the cores, at most 4",
        low=0,
        high=1024,
    )
    model_load_on_demand: int = _field(
        0,
        "1: list the repository's models without loading them; a model loads on its first "
        "request (which waits for it up to --model-load-wait-seconds, as every request that "
        "arrives while it loads: one load however many ask), and leaves again under "
        "--models-max and --model-idle-unload-seconds (docs/operations.md, on-demand models); "
        "not with --model-control-mode poll",
    )
    models_max: int = _field(
        0,
        "with --model-load-on-demand 1: most repository models loaded at once (an ensemble's "
        "steps count, the ensemble itself does not); the least recently used one with no "
        "request in flight is unloaded to make room; 0: no limit",
        low=0,
    )
    model_idle_unload_seconds: float = _field(
        0.0,
        "with --model-load-on-demand 1: a repository model with no request for this long is "
        "unloaded (its memory given back); 0: never",
        low=0,
    )
    model_min_loaded_seconds: float = _field(
        2.0,
        "with --model-load-on-demand 1 and --models-max: a model loaded on demand stays at "
        "least this long before it may be unloaded to make room for another (a client "
        "naming models in turn would otherwise make a load and an unload of each request: "
        "this bounds the loads to --models-max in this many seconds); 0: no minimum",
        low=0,
    )
    model_load_wait_seconds: float = _field(
        60.0,
        "with --model-load-on-demand 1: how long a request for a model that is loading (or "
        "waiting for room under --models-max) waits; past it UNAVAILABLE / 503 with "
        "Retry-After",
        low=0.1,
    )
    plugins: str = _field("", "JSON file naming the plugins to load and their config")
    default_device: str = _field("NUMPY", "device for models whose config names none")
    log_level: str = _field("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = _field(
        "text", "text: 'time LEVEL logger: message' lines; json: one JSON object per line"
    )
    exit_on_error: int = _field(
        1,
        "1: exit with status 1, naming the models, when the model repository is missing or a "
        "model in it (or in the bundled examples) fails to load at startup, an ensemble's step "
        "among them (as Triton); 0: log it and serve what loaded, not ready while "
        "--strict-readiness is 1",
    )
    strict_readiness: int = _field(
        1,
        "1: the server is ready (/v2/health/ready, ServerReady, gRPC health) only while every "
        "model it was asked to serve is loaded and every ensemble's steps are (as Triton); "
        "0: ready once started, whatever failed",
    )
    reuse_grpc_port: int = _field(
        0,
        "1: share --grpc-port with other processes listening on it (SO_REUSEPORT; each "
        "connection goes to one of them); 0: an occupied port is an error",
    )
    max_message_bytes: int = _field(
        1 << 30,
        "largest gRPC message accepted or sent, largest REST request body, and the most bytes "
        "of outputs one answer carries on any protocol",
        low=1,
        high=2**31 - 1,  # gRPC keeps message limits in an int32
    )
    queue_size: int = _field(
        0, "requests waiting per network (0: 16 per stream, at least 64)", low=0
    )
    grpc_workers: int = _field(
        64,
        "gRPC handler threads at most (streams and calls waiting on a busy network hold one)",
        low=1,
    )
    grpc_active_workers: int = _field(
        0,
        "gRPC handler threads that run calls at once; more start, up to --grpc-workers, only "
        "while calls wait or stall (fewer threads contend less for Python's GIL; 0: the cores, "
        "at least 2)",
        low=0,
    )
    exit_timeout: float = _field(30.0, "seconds to finish admitted requests on SIGTERM", low=0)
    model_unload_timeout: float = _field(
        30.0,
        "seconds an unload (or a reload's replaced version) waits for the requests its model "
        "admitted before it closes the model; what still runs then is cancelled and answered "
        "UNAVAILABLE / 503 with Retry-After",
        low=0,
    )
    max_inflight_bytes: int = _field(
        -1,
        "memory all requests in flight may hold at once, on every protocol, charged before "
        "a request is decoded (a REST body as it arrives; JSON tensors at 20x their size, "
        "binary 2x); over it a "
        "request is refused at once (RESOURCE_EXHAUSTED / 503); -1: half of the cgroup's "
        "memory limit or of the machine's memory; 0: no limit",
        low=-1,
    )
    max_completion_tokens: int = _field(
        0,
        "most tokens one OpenAI completion or chat request may ask to generate per choice "
        "(max_tokens / max_completion_tokens above it: 400; unset: the model's remaining context "
        "up to this); 0: the model's context length only",
        low=0,
    )
    max_logprobs: int = _field(
        20,
        "most alternatives per token an OpenAI request may ask for (chat's top_logprobs, "
        "completions' logprobs, vLLM's prompt_logprobs; above it: 400 naming the field and "
        "this bound); a request's -1 (vLLM's: the whole vocabulary) is allowed only when this "
        "is at least the model's vocabulary size; -1: the vocabulary's size (no bound). Each "
        "alternative costs ~160 bytes per token, charged to --max-inflight-bytes before the "
        "request starts (docs/openai.md)",
        low=-1,
    )
    responses_store_entries: int = _field(
        1024,
        "OpenAI /v1/responses: most responses kept for previous_response_id and GET/DELETE by "
        "id; the oldest goes first (docs/openai.md)",
        low=0,
    )
    responses_store_bytes: int = _field(
        64 << 20,
        "OpenAI /v1/responses: most bytes the kept responses hold, charged to "
        "--max-inflight-bytes while kept; the oldest goes first; 0: nothing is kept (every "
        "request acts as store: false)",
        low=0,
    )
    responses_store_tenant_entries: int = _field(
        -1,
        "OpenAI /v1/responses: most responses one tenant keeps (a token, or a tenant= of the "
        "--auth-tokens file); a new one evicts its own tenant's oldest only; -1: an equal "
        "share of --responses-store-entries among the tenants; 0: up to the store's bound",
        low=-1,
    )
    responses_store_tenant_bytes: int = _field(
        -1,
        "OpenAI /v1/responses: most bytes one tenant's kept responses hold; -1: an equal share "
        "of --responses-store-bytes among the tenants; 0: up to the store's bound",
        low=-1,
    )
    responses_store_seconds: float = _field(
        3600.0,
        "OpenAI /v1/responses: a kept response older than this is gone (0: kept until the "
        "entries or bytes bounds evict it)",
        low=0,
    )
    tool_call_parser: str = _field(
        "auto",
        "how tool calls are read out of a chat's answer (OpenAI's tool_choice auto): auto (each "
        "model's family, from its chat template's markup), none (calls stay text), or a "
        "family: hermes (Qwen2.5, Qwen3), qwen3_coder, llama3_json, mistral, pythonic "
        "(Llama 4); docs/openai.md",
    )
    served_model_name: str = _field(
        "",
        "OpenAI API: another name for a repository model, NAME=MODEL (vLLM's "
        "--served-model-name): NAME may hold '/', as a Hugging Face id does "
        "(facebook/opt-125m=opt); repeat the flag or separate by commas",
        repeat=True,
    )
    reasoning_parser: str = _field(
        "auto",
        "how a reasoning model's thinking is split out of its answer (reasoning_content): "
        "auto (a chat template writing <think> ... </think>), none, or think (Qwen3, "
        "DeepSeek-R1; also named qwen3, deepseek_r1)",
    )
    max_request_seconds: float = _field(
        300.0,
        "longest an inference request may take from admission to its answer, queued and "
        "running; past it the run is stopped and the client gets DEADLINE_EXCEEDED (504), as "
        "for its own deadline (0: no server limit)",
        low=0,
    )
    tls_cert: str = _field(
        "", "PEM certificate chain for TLS on the gRPC and REST ports; empty: plaintext"
    )
    tls_key: str = _field("", "PEM private key of --tls-cert")
    tls_client_ca: str = _field(
        "", "PEM CA bundle: clients must present a certificate it signed (mutual TLS)"
    )
    auth_tokens: str = _field(
        "", "file of 'TOKEN ROLE' lines (roles: infer, admin); empty: no token auth"
    )
    open_health: int = _field(1, "1: the health service needs no token; 0: it needs one")
    allow_remote_control: int = _field(
        0,
        "without --auth-tokens: 1 lets any client load, unload, import, export and set device "
        "config; 0 takes them from this machine (loopback) only. With tokens, roles decide",
    )
    allow_code_from_clients: int = _field(
        0,
        "1: models that run code when loaded (PyTorch programs: TorchScript, .pt2; Python "
        "models' model.py; a Python model's EXECUTION_ENV_PATH) load from what clients send "
        "(LoadNetwork and ImportNetwork bytes, a repository load's file overrides), and loading "
        "one runs its code; 0: they load only from the model repository on disk",
    )
    open_reflection: int = _field(0, "1: reflection needs no token; 0: it needs one")
    max_networks: int = _field(0, "most network versions loaded at once (0: no limit)", low=0)
    max_sequences: int = _field(
        1024,
        "most sequences (Triton's sequence batching) active at once over every model; a new "
        "one beyond is refused with RESOURCE_EXHAUSTED (0: no limit)",
        low=0,
    )
    max_model_bytes: int = _field(
        0,
        "largest model or blob LoadNetwork/ImportNetwork accepts (0: no limit)",
        low=0,
    )
    max_read_bytes: int = _field(
        -1,
        "memory one read of a model (QueryNetwork, LoadNetwork, a repository load) may take "
        "for the values it computes: onnx's shape inference and data propagation (bounded in "
        "a helper process), dense sparse initializers, folded constants; charged to "
        "--max-inflight-bytes while the read runs. Real models need a few MB; a 1 KB model "
        "asked onnx for 3.6 GB. -1: a quarter of --max-inflight-bytes, between 16 and 256 MiB "
        "(256 MiB without a budget); 0: no limit",
        low=-1,
    )
    max_read_seconds: float = _field(
        30.0,
        "seconds onnx's shape inference of one model may take, OPENVINO's query of it, and "
        "a client's QueryNetwork in all (real models: milliseconds, a second); past it the "
        "read or query is refused with RESOURCE_EXHAUSTED; 0: no limit",
        low=0,
    )
    max_model_nodes: int = _field(
        250_000,
        "most nodes a model may have, its subgraphs' and functions' included, checked right "
        "after it is parsed (exporters' largest graphs have tens of thousands); more: "
        "INVALID_ARGUMENT; 0: no limit",
        low=0,
    )
    max_string_elements: int = _field(
        1 << 22,
        "most BYTES elements one request tensor may hold, checked before any is decoded (each "
        "becomes a Python object: short strings grow ~15x in memory); more: INVALID_ARGUMENT",
        low=1,
    )
    max_num_streams: int = _field(
        64,
        "largest NUM_STREAMS a load, import or SetConfig may ask for (each stream is a thread "
        "and backend state); 0: no limit",
        low=0,
    )
    max_batch_size: int = _field(
        256,
        "largest BATCH_SIZE (BATCH:D(n)) a load, import or SetConfig may ask for (a BATCH "
        "network waits with twice that many threads); 0: no limit",
        low=0,
    )
    max_inference_threads: int = _field(
        256,
        "largest INFERENCE_NUM_THREADS a load, import or SetConfig may ask for; 0: no limit",
        low=0,
    )
    max_open_streams: int = _field(
        0,
        "streaming gRPC calls open at once, server-wide; the rest of the --grpc-workers threads "
        "stay for unary calls (0: half of --grpc-workers)",
        low=0,
    )
    request_read_timeout: float = _field(
        30.0,
        "seconds a gRPC call may take to send its request message, and an HTTP connection its "
        "request headers and body, before it is cancelled (HTTP: closed, or 408)",
        low=0.1,
    )
    http_min_body_rate: int = _field(
        1024,
        "slowest a REST request body may come, in bytes a second on average, once "
        "--http-body-grace seconds have passed since its headers; slower: 408 and the "
        "connection closed (sooner when the port is full and needs its slot); 0: no minimum. "
        "The whole body must be in within --request-read-timeout too, whichever comes first",
        low=0,
    )
    http_body_grace: float = _field(
        5.0,
        "seconds a REST request body may take before --http-min-body-rate applies to it",
        low=0,
    )
    http_peer_connections: int = _field(
        -1,
        "most REST connections one client address may hold that serve no request of its "
        "(idle, waiting for headers, a body coming without a token, refused): past it, a new "
        "one first closes that address's idle, refused or slow ones, and a request on a "
        "connection still past it is answered 503 (health probes excepted). A request read "
        "whole (or, with --auth-tokens, whose token is valid) is not counted: 200 requests "
        "in flight from one address are served; -1: half of the REST port's limit "
        "(4 x --grpc-workers); 0: no bound but the port's (behind a proxy that hides client "
        "addresses)",
        low=-1,
    )
    grpc_token_calls: int = _field(
        -1,
        "most gRPC calls one token's tenant may have running at once, each on one of "
        "--grpc-workers threads for as long as it runs (a call waiting in a busy network's "
        "queue too); past it RESOURCE_EXHAUSTED. -1: its share of --grpc-workers (seven "
        "eighths alone, less as more tenants have calls running: docs/security.md), 0: no "
        "bound; without --auth-tokens it plays no part",
        low=-1,
    )
    http_token_requests: int = _field(
        -1,
        "most REST requests one token (one tenant) may have in flight at once, from its "
        "headers to its answer; past it 429 with Retry-After. A request with a valid token is "
        "bounded by this, not by --http-peer-connections (a gateway or proxy is one address). "
        "-1: its share of the REST port's limit (224 of 256 alone at the defaults, less as "
        "more tokens have requests in flight: docs/security.md), 0: no bound but the port's; "
        "without --auth-tokens it plays no part",
        low=-1,
    )
    max_inflight_bytes_per_peer: int = _field(
        -1,
        "memory the REST requests of one client address may hold at once, charged as their "
        "bodies arrive (its share of --max-inflight-bytes); over it: 503 (OpenAI routes 429); "
        "-1: half of --max-inflight-bytes; 0: no bound but the budget's",
        low=-1,
    )
    stream_idle_timeout: float = _field(
        300.0,
        "seconds a gRPC stream (or connection) may stay without a message before it is closed "
        "(0: never)",
        low=0,
    )
    max_streams_per_connection: int = _field(
        0,
        "concurrent gRPC streams per client connection (0: gRPC's default)",
        low=0,
        high=2**31 - 1,
    )
    shared_memory: str = _field(
        "system",
        "system: Triton's system shared memory extension for clients on this machine; off: "
        "refused (UNIMPLEMENTED / 501)",
    )
    shared_memory_prefix: str = _field(
        "/plugserve",
        "keys a client may register as shared memory regions must start with this (a key "
        "names a file in /dev/shm; '/' allows any, as Triton); with --auth-tokens, '{tenant}' "
        "in it is the registering token's tenant, so each tenant has keys of its own "
        "(/plugserve_{tenant}_)",
    )
    malloc_reuse_bytes: int = _field(
        32 << 20,
        "glibc: freed blocks up to this size are reused, not unmapped and faulted in again "
        "per request (0: the C library's defaults; at most 32 MiB)",
        low=0,
        high=32 << 20,
    )
    trace_config: str = _field(
        "",
        "OpenTelemetry traces, as Triton's flag (repeat it): level=OFF|TIMESTAMPS|TENSORS, "
        "rate=N (1 in N requests), count=N (-1: no end), mode=opentelemetry, "
        "opentelemetry,url=HOST:PORT/v1/traces, opentelemetry,resource=KEY=VALUE, "
        "opentelemetry,bsp_max_queue_size=N (bsp_schedule_delay, bsp_max_export_batch_size); "
        "empty: nothing traced until a trace-setting request turns it on (docs/tracing.md; "
        "needs pip install 'plugserve[trace]')",
        repeat=True,
    )
    # generative models (server/apps/generate/): defaults for models whose config sets none
    # (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, KV_CACHE_BYTES, KV_OFFLOADING_SIZE, KV_DISK_PATH,
    # KV_DISK_SIZE, MAX_MODEL_LEN, ENABLE_PREFIX_CACHING, ASYNC_SCHEDULING, STREAM_INTERVAL)
    max_num_seqs: int = _field(
        16,
        "generative models: sequences generated at once (each holds a cache slot of the whole "
        "context); more requests wait",
        low=1,
    )
    max_num_batched_tokens: int = _field(
        0,
        "generative models: tokens computed in one engine step (each decoding sequence's one, "
        "plus prompt tokens; a longer prompt is computed in chunks of what is left); 0: the "
        "device's default, 256 where a step's graph returns every position's logits (ORT, "
        "OPENVINO, NUMPY), 512 on TORCH's CPU, 2048 on a card",
        low=0,
    )
    kv_cache_bytes: int = _field(
        0,
        "generative models: bytes of key/value cache per model (0: --max-num-seqs sequences of "
        "the whole context, at most a quarter of the machine's memory)",
        low=0,
    )
    kv_offloading_size: float = _field(
        0.0,
        "generative models: GiB of host memory per model keeping the key/value blocks evicted "
        "from the cache's slots, restored into a later prompt that begins with them instead of "
        "computed again (vLLM's flag; least recently used leave first; charged to "
        "--max-inflight-bytes while kept, at most half of it); 0: off. Every cache layout (dense "
        "slots, OPENVINO's paged IR, the torch decoder's tensors); ignored, logged, on a u8 "
        "paged cache (server/apps/generate/engine/kv_host_tier.py)",
        low=0,
    )
    kv_disk_path: str = _field(
        "",
        "generative models: a directory where the blocks the host tier drops "
        "(--kv-offloading-size) are kept in files, one folder per model, restored into a later "
        "prompt that begins with them (LMCache's local disk); each file carries its model's "
        "identity and a checksum, and a restart keeps the valid ones. Empty: off "
        "(server/apps/generate/engine/kv_disk_tier.py)",
    )
    kv_disk_size: float = _field(
        0.0,
        "generative models: GiB of block files per model under --kv-disk-path (least recently "
        "used deleted first; a size over the directory's free space is refused at start; disk "
        "bytes are not charged to --max-inflight-bytes, the blocks queued for writing are); "
        "0: off",
        low=0,
    )
    max_model_len: int = _field(
        0,
        "generative models: longest sequence, prompt and answer (0: the model's context "
        "length); a shorter one makes each cache slot smaller",
        low=0,
    )
    enable_prefix_caching: int = _field(
        1, "generative models: 1: reuse the cache of prompts' common beginnings; 0: never"
    )
    async_scheduling: int = _field(
        1,
        "generative models: 1: on a decoder that can (safetensors folders on TORCH or GPU), "
        "launch each steady decode step before the previous step's tokens are sent, its ids "
        "taken on the device (server/apps/generate/engine/overlap.py); 0: every step synchronous",
    )
    stream_interval: int = _field(
        1,
        "generative models: tokens a sequence's stream sends together (vLLM's "
        "--stream-interval): its first token at once, then one event per N tokens, its last "
        "with what is left; 1: every token at once; more trades the stream's smoothness for "
        "the host's CPU per token (server/apps/generate/engine/output.py)",
        low=1,
        high=1024,
    )
    generate_warmup: str = _field(
        "default",
        "generative models: what a model generates before it is reported ready (and again at "
        "each wake), so the first request is not the slow one: off (one two-token check), "
        "default (a 16-token prompt at batch size 1; on a CUDA card batch sizes 1, 2, 4 ... "
        "up to --max-num-seqs; the default: a tiny test model's load takes ~0.05 s more, reloads "
        "stay flat), or a JSON "
        'object such as \'{"batch_sizes": [1, 8], "prompt_lens": [16, 512]}\' (every size '
        "with every length, long prompts too); a model's WARMUP config key overrides it "
        "(server/apps/generate/engine/warmup.py, docs/operations.md)",
    )
    max_prompt_bytes: int = _field(
        0,
        "generative models: most bytes of prompt text (UTF-8) a request may send on any face "
        "(OpenAI, KServe generate, Triton's text_input), refused with 400 before it is "
        "rendered or tokenized; 0: what the model's context could hold, its context length "
        "times its longest token's bytes (server/apps/generate/limits.py)",
        low=0,
    )
    max_json_values: int = _field(
        1 << 20,
        "OpenAI routes and KServe generate: most JSON values (objects, arrays, items) one "
        "request body may hold, counted before it is parsed; more is 413. A parsed value holds "
        "up to ~110 bytes, so bytes alone did not bound a body: 95 MB of small objects grew "
        "the server by 2.9 GB (server/protocols/http/json_bounds.py)",
        low=1,
    )
    max_json_depth: int = _field(
        64,
        "OpenAI routes and KServe generate: deepest nesting of arrays and objects in a "
        "request body; deeper is 400",
        low=1,
        high=1000,
    )
    max_stream_unread_bytes: int = _field(
        1 << 20,
        "generative models: bytes of events a generation stream (OpenAI or KServe "
        "generate_stream server-sent events, gRPC ModelStreamInfer) may leave unread in the "
        "server; past it the request is cancelled and its sequence's cache slot freed",
        low=1,
    )

    kv_events_config: str = _field(
        "",
        "generative models: KV events in vLLM's wire format, vLLM's --kv-events-config JSON: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558", "topic": "kv-events"}\' publishes each prefix-cache block stored and '
        "removed (msgpack KVEventBatch over a ZeroMQ PUB socket, a ROUTER socket for replays); "
        "buffer_steps (10000), max_queue_size (100000, the oldest batch dropped past it) and hwm "
        "(100000) bound it. Empty: off (server/apps/generate/engine/kvevents.py, docs/generate.md)",
    )

    def kv_events(self) -> Any:
        """--kv-events-config read (``kvevents.Config``; InvalidArgument naming what is wrong)."""
        from plugserve.server.apps.generate.engine.kvevents import Config

        return Config.parse(self.kv_events_config)

    def generate_defaults(self, kv_events: Any = None) -> Any:
        """The engine settings these flags give (server/apps/generate/engine/engine.py), with the
        server's KV-events publisher (``kvevents.Publisher``; None: off)."""
        from plugserve.server.apps.generate.engine.engine import EngineSettings

        return EngineSettings(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_bytes=self.kv_cache_bytes,
            kv_offloading_size=self.kv_offloading_size,
            kv_disk_path=self.kv_disk_path,
            kv_disk_size=self.kv_disk_size,
            max_model_len=self.max_model_len,
            enable_prefix_caching=bool(self.enable_prefix_caching),
            async_scheduling=bool(self.async_scheduling),
            stream_interval=self.stream_interval,
            warmup=self.generate_warmup,
            kv_events=kv_events,
        )

    def problems(self) -> list[str]:
        """What is out of range, one message per field (empty when all is well)."""
        found = []
        for f in dataclasses.fields(self):
            low, high = f.metadata["low"], f.metadata["high"]
            value = getattr(self, f.name)
            if low is not None and (
                value != value or value < low or (high is not None and value > high)
            ):  # NaN too
                found.append(
                    f"{f.name}={value!r} must be "
                    + (f"between {low} and {high}" if high is not None else f">= {low}")
                )
        for name in (
            "gpu_metrics",
            "exit_on_error",
            "strict_readiness",
            "reuse_grpc_port",
            "allow_remote_control",
            "allow_code_from_clients",
            "enable_prefix_caching",
            "async_scheduling",
            "model_load_on_demand",
        ):
            if getattr(self, name) not in (0, 1):
                found.append(f"{name}={getattr(self, name)!r} must be 0 or 1")
        if self.model_control_mode not in _CONTROL_MODES:
            found.append(
                f"model_control_mode={self.model_control_mode!r} must be one of "
                "none, explicit, poll (or empty)"
            )
        if self.model_load_on_demand and self.model_control_mode == "poll":
            found.append(
                "model_load_on_demand=1 cannot go with model_control_mode='poll' (the poll "
                "would load every model the repository holds)"
            )
        if not self.model_load_on_demand:
            for name in ("models_max", "model_idle_unload_seconds"):
                if getattr(self, name):
                    found.append(f"{name}={getattr(self, name)!r} needs --model-load-on-demand 1")
        if self.load_model and self.model_control_mode != "explicit":
            found.append(f"load_model={self.load_model!r} needs --model-control-mode explicit")
        if self.shared_memory not in ("system", "off"):
            found.append(f"shared_memory={self.shared_memory!r} must be system or off")
        if not self.shared_memory_prefix.startswith("/"):
            found.append(f"shared_memory_prefix={self.shared_memory_prefix!r} must start with '/'")
        from plugserve.plugins.api import InvalidArgument
        from plugserve.server.apps.generate import reasoning, tool_parsers
        from plugserve.server.apps.generate.engine import warmup

        # the fields a reader parses, raising an error that names what is wrong
        for name, read in (
            ("generate_warmup", lambda: warmup.parse(self.generate_warmup)),
            ("kv_events_config", self.kv_events),
            ("trace_config", self.trace),
            ("served_model_name", self.served_names),
        ):
            try:
                read()
            except (InvalidArgument, ValueError) as exc:
                found.append(f"{name}={getattr(self, name)!r}: {exc}")
        for name, names in (
            ("tool_call_parser", tool_parsers.NAMES),
            ("reasoning_parser", reasoning.NAMES),
            ("log_format", _LOG_FORMATS),
        ):
            if getattr(self, name) not in names:
                found.append(f"{name}={getattr(self, name)!r} must be one of {', '.join(names)}")
        if self.log_level.upper() not in _LOG_LEVELS:
            found.append(f"log_level={self.log_level!r} must be one of {', '.join(_LOG_LEVELS)}")
        return found

    def served_names(self) -> dict[str, str]:
        """--served-model-name read: each other name -> the repository model it stands for
        (raises ValueError naming a pair that is not NAME=MODEL)."""
        names: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in self.served_model_name.split(","))):
            alias, sep, name = (part.strip() for part in pair.partition("="))
            if not sep or not alias or not name:
                raise ValueError(f"{pair!r} is not NAME=MODEL")
            names[alias] = name
        return names

    def trace(self) -> TraceConfig:
        """--trace-config read (raises ValueError naming a wrong option)."""
        return TraceConfig.parse(self.trace_config)

    def read_bytes(self, budget: int) -> int:
        """--max-read-bytes made concrete, for a memory budget of ``budget`` bytes (0: none):
        a quarter of it leaves room for requests while reads run (one read of a real model
        needs a few MB: shape inference took 4-5 MB for 621- and 873-node decoders), with a
        floor for tiny budgets and a ceiling far above real needs."""
        if self.max_read_bytes >= 0:
            return self.max_read_bytes
        if not budget:
            return 256 << 20
        return min(256 << 20, max(16 << 20, budget // 4))

    def load_threads(self) -> int:
        """--model-load-threads, 0 made concrete: loads are CPU work (parsing, checking and
        optimizing models), so more at once than cores only adds contention."""
        if self.model_load_threads:
            return self.model_load_threads
        return min(4, available_cores())

    def active_grpc_workers(self) -> int:
        """--grpc-active-workers, 0 made concrete: a thread per core, at least two (the cores
        this process may run on: a container's CPU set, not the host's). Every thread beyond
        that only queues for the GIL: on 2 cores, 2 threads served a tiny request ~1.25x as
        fast at 16 in flight as 3 did and ~1.75x as fast as 6 (BENCHMARKS.md, "A tiny
        request's cost, fourth pass"). Threads waiting, or in a long run, do not count (see
        ``callpool.blocked``), so the few that run calls are the ones running Python."""
        return min(self.grpc_workers, self.grpc_active_workers or max(2, available_cores()))

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"PLUGSERVE_{field.upper()}"

    @classmethod
    def flag(cls, field: str) -> str:
        f = next(f for f in dataclasses.fields(cls) if f.name == field)
        return f.metadata.get("flag") or "--" + f.name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            parser.add_argument(
                cls.flag(f.name),
                dest=f.name,
                default=None,
                type=type(f.default),
                action="append" if f.metadata["repeat"] else "store",
                help=f"{f.metadata['help']} (env {cls.env_name(f.name)}, default {f.default!r})",
            )

    @classmethod
    def load(
        cls, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in dataclasses.fields(cls):
            raw = getattr(args, f.name, None) if args is not None else None
            if isinstance(raw, list):  # a repeated flag
                raw = ",".join(raw)
            if raw is not None:
                sources[f.name] = cls.flag(f.name)
            elif cls.env_name(f.name) in environ:
                text = environ[cls.env_name(f.name)]
                try:
                    raw = type(f.default)(
                        text.strip() if isinstance(f.default, int | float) else text
                    )
                except ValueError:
                    raise SystemExit(
                        f"plugserve: {cls.env_name(f.name)}={text!r} is not a valid "
                        f"{type(f.default).__name__}"
                    ) from None
                sources[f.name] = cls.env_name(f.name)
            if raw is not None:
                values[f.name] = raw
        settings = cls(**values)
        problems = settings.problems()
        if problems:
            detail = "; ".join(
                f"{p} (from {sources.get(p.partition('=')[0], 'the default')})" for p in problems
            )
            raise SystemExit(f"plugserve: invalid settings: {detail}")
        return settings

    @classmethod
    def from_argv(cls, argv: Sequence[str], prog: str = "plugserve serve") -> Settings:
        parser = argparse.ArgumentParser(prog=prog, description="Run the plugserve server.")
        cls.add_arguments(parser)
        return cls.load(parser.parse_args(argv))

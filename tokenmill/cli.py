"""`tokenmill generate | serve | bench | sim` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenmill.tool_parsers import PARSERS

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.config import KV_CACHE_DTYPES, LORA_DTYPES, EngineConfig

    defaults = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, action="append",
                   help="GGUF file or HF directory (default: bundled SmolLM2-135M); serve: NAME=PATH, repeated, "
                        "serves several models")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) instead of the model's")
    g.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                   help="split the <think> block of a reasoning model's output from its answer (reasoning_content)")
    g.add_argument("--device", default=defaults.device)
    g.add_argument("--dtype", default=defaults.dtype, choices=["float32", "float16", "bfloat16"])
    g.add_argument("--quantization", "-q", default=defaults.quantization,
                   choices=["auto", "none", "int8", "bf16", "gguf"],
                   help="linear-layer weights: auto = fastest this CPU supports; none = float32, exact; "
                        "gguf = a GGUF file's quantized blocks executed as stored")
    g.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache elements: auto = bfloat16 with quantized linears on CPUs whose attention kernel "
                        "reads it, else the model's dtype; int8 / fp8 (= fp8_e4m3) / fp8_e5m2: 8 bits with a scale "
                        "per token and KV head, twice the tokens of bfloat16 in the same memory")
    g.add_argument("--block-size", type=int, default=defaults.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gb", type=float, default=defaults.kv_cache_memory_gb)
    g.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization,
                   help="GPU: the share of device memory the weights, activations and KV pool may take")
    g.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run decode steps eagerly instead of replaying CUDA graphs captured at start-up")
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    g.add_argument("--target-itl-ms", type=float, default=None,
                   help="size prompt chunks so that steps with decodes running stay within this many ms (the "
                        "step time is predicted by a model fitted online, with a margin from its recent errors); "
                        "without decodes prompts get the whole --max-num-batched-tokens; short prompts go ahead of "
                        "longer ones by at most one chunk")
    g.add_argument("--step-cost-profile", default=None, metavar="JSON",
                   help="with --target-itl-ms: a `tokenmill sim calibrate` profile of this machine to start the "
                        "step-time predictor from (otherwise it learns from the first steps)")
    g.add_argument("--max-num-partial-prefills", type=int, default=defaults.max_num_partial_prefills)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=defaults.enable_chunked_prefill,
                   help="split long prompts over steps under the token budget (--no-enable-chunked-prefill: a "
                        "prompt waits until all of it fits in one step)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--kv-offload-memory", dest="kv_offload_memory_gb", type=float,
                   default=defaults.kv_offload_memory_gb, metavar="GB",
                   help="keep prefix blocks evicted from the KV pool in this much host memory, as the pool stores "
                        "them (compact with --kv-cache-dtype int8); prompts read them back instead of prefilling")
    g.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="keep prefix blocks on disk too, across restarts (a namespace per model file and KV "
                        "settings; checksummed files, atomic writes)")
    g.add_argument("--kv-cache-dir-size", dest="kv_cache_dir_size_gb", type=float,
                   default=defaults.kv_cache_dir_size_gb, metavar="GB",
                   help="the disk tier's size; least recently used blocks go first")
    g.add_argument("--policy", default=defaults.policy, choices=["fcfs", "priority"])
    g.add_argument("--priority-aging-per-s", type=float, default=defaults.priority_aging_per_s)
    g.add_argument("--batching", default=defaults.batching, choices=["continuous", "dynamic", "static"])
    g.add_argument("--seed", type=int, default=defaults.seed)
    g.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests)
    g.add_argument("--migration-limit", type=int, default=defaults.migration_limit,
                   help="times a request moves to another engine core when its core dies, continuing from the "
                        "tokens it has streamed (0: it fails)")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    g.add_argument("--max-loras", type=int, default=defaults.max_loras,
                   help="adapters resident (and running) at once")
    g.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank)
    g.add_argument("--lora-dtype", default=defaults.lora_dtype, choices=list(LORA_DTYPES),
                   help="the resident adapters' weights (auto: bfloat16 under quantized linears)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras)")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}\'')
    g.add_argument("--task", choices=["auto", "generate", "embed"], default=defaults.task,
                   help="generate, or embed (/v1/embeddings, /rerank, /score on an encoder: BERT, nomic-bert); "
                        "auto: what the model file is")
    g.add_argument("--runner", choices=["auto", "generate", "pooling"], default=None,
                   help="vLLM's name for --task: pooling = embed")
    g.add_argument("--pooler-config", type=_json_object, default=None,
                   help='task embed: \'{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true}\' (default: '
                        "what the model file says)")
    g.add_argument("--hf-overrides", type=_json_object, default=None,
                   help='task embed: \'{"matryoshka_dimensions": [768, 512, 256, 128, 64]}\' allows truncated '
                        "embeddings (the dimensions field) for a model trained for them whose file does not say so")


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("give a JSON object")
    return parsed


def _cache_salt_source(value: str) -> str:
    from tokenmill.server.cache_salt import check_source

    try:
        return check_source(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _one_model(models: list[str] | None) -> str | None:
    """--model given once (or not at all): its path."""
    if not models:
        return None
    if len(models) > 1:
        raise SystemExit(f"--model given {len(models)} times: several models are served as --model NAME=PATH")
    return models[0]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from tokenmill.config import EngineConfig

    return EngineConfig(
        model=_one_model(args.model), chat_template=args.chat_template, reasoning_parser=args.reasoning_parser,
        device=args.device, dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        target_itl_ms=args.target_itl_ms, step_cost_profile=args.step_cost_profile,
        max_num_partial_prefills=args.max_num_partial_prefills, max_model_len=args.max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, kv_offload_memory_gb=args.kv_offload_memory_gb,
        kv_cache_dir=args.kv_cache_dir, kv_cache_dir_size_gb=args.kv_cache_dir_size_gb, policy=args.policy,
        priority_aging_per_s=args.priority_aging_per_s, batching=args.batching, seed=args.seed,
        max_waiting_requests=args.max_waiting_requests, migration_limit=args.migration_limit,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype,
        task={"pooling": "embed", "generate": "generate", "auto": "auto", None: args.task}[args.runner],
        pooler_config=args.pooler_config, hf_overrides=args.hf_overrides,
    )


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.sampling_seed, stop=args.stop)
    records: list[dict[str, Any]] = []
    if args.input:
        with open(args.input) as f:
            records = [json.loads(line) for line in f if line.strip()]
    records += [{"prompt": p} for p in args.prompts]
    if not records:
        print("give a prompt or --input prompts.jsonl", file=sys.stderr)
        return 2
    llm = LLM(config=engine_config_from_args(args))
    prompts: list[Any] = []
    for record in records:
        if "messages" in record or args.chat:
            messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
            prompts.append({"prompt_token_ids": llm.tokenizer.encode_chat(messages)})
        elif "prompt_token_ids" in record:
            prompts.append({"prompt_token_ids": record["prompt_token_ids"]})
        else:
            prompts.append(record["prompt"])
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1 or bool(args.input))
    if args.output:
        with open(args.output, "w") as f:
            for record, out in zip(records, outputs):
                c = out.outputs[0]
                f.write(json.dumps({**record, "generated_text": c.text, "token_ids": c.token_ids,
                                    "finish_reason": c.finish_reason,
                                    "prompt_tokens": len(out.prompt_token_ids)}) + "\n")
        print(f"wrote {len(outputs)} results to {args.output}", file=sys.stderr)
    else:
        for out in outputs:
            print(out.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.server.app import ServerOptions, run_server
    from tokenmill.server.lora_api import parse_lora_modules

    named = [m for m in args.model or [] if "=" in m]
    if named or args.model_dir:
        if args.model_path is not None or len(named) != len(args.model or []):
            raise SystemExit("several models are given as --model NAME=PATH (repeated) or --model-dir, not as paths")
    elif args.model_path is not None:
        if args.model is not None and args.model != [args.model_path]:
            raise SystemExit(f"two models given: {args.model_path!r} and --model {_one_model(args.model)!r}")
        args.model = [args.model_path]

    options = ServerOptions(
        served_model_name=args.served_model_name, api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes, request_timeout=args.request_timeout,
        shutdown_timeout=args.shutdown_timeout, enable_log_requests=args.enable_log_requests,
        disable_log_stats=args.disable_log_stats, disable_access_log=args.disable_uvicorn_access_log,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        tool_call_parser_strict=args.tool_call_parser_strict, drift_probe=args.drift_probe,
        drift_probe_interval=args.drift_probe_interval, drift_logprob_tolerance=args.drift_logprob_tolerance,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        step_trace=args.step_trace, data_parallel_size=args.data_parallel_size, router=args.router,
        distributed_executor_backend=args.distributed_executor_backend, disaggregated=args.disaggregated,
        kv_transport=args.kv_transport, enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        responses_store_size=args.responses_store_size, lora_modules=parse_lora_modules(args.lora_modules),
        enable_runtime_lora_updating=args.enable_runtime_lora_updating, lora_dir=args.lora_dir,
        cache_salt_source=args.cache_salt_source,
    )
    if named or args.model_dir:
        from tokenmill.server.model_pool import models_in_dir, parse_model_specs, run_model_pool_server

        models = parse_model_specs(named) | (models_in_dir(args.model_dir) if args.model_dir else {})
        args.model = None
        return run_model_pool_server(models, engine_config_from_args(args), host=args.host, port=args.port,
                                     options=options, max_loaded=args.max_loaded_models, log_level=args.log_level,
                                     model_dir=args.model_dir, admin_api_key=args.admin_api_key,
                                     swap_min_agreement=args.swap_min_agreement)
    from tokenmill.encoder.config import resolve_task
    from tokenmill.model.metadata import resolve_model_path

    config = engine_config_from_args(args)
    task, encoder = resolve_task(resolve_model_path(config.model), config.task)
    config = replace(config, task=task)
    if encoder:  # its inputs run whole, from no cache: nothing of these applies to it
        unsupported = [flag for flag, used in (
            ("--disaggregated", bool(options.disaggregated)),
            ("--distributed-executor-backend ray", options.distributed_executor_backend == "ray"),
            ("--enable-lora / --lora-modules", config.enable_lora or bool(options.lora_modules)),
            ("--speculative-config", config.speculative_config is not None),
            ("--kv-offload-memory / --kv-cache-dir", bool(config.kv_offload_memory_gb or config.kv_cache_dir)),
            ("--drift-probe", bool(options.drift_probe)))
            if used]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} do not apply to an encoder served for embeddings")
    return run_server(config, host=args.host, port=args.port, options=options, log_level=args.log_level)


Subcommand = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _add_subcommands(parser: argparse.ArgumentParser, dest: str, commands: list[Subcommand]) -> None:
    """One subparser per (name, help, add its arguments, run it)."""
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, help_text, add_args, run in commands:
        command = sub.add_parser(name, help=help_text)
        add_args(command)
        command.set_defaults(func=run)


def _add_bench_commands(bench: argparse.ArgumentParser) -> None:
    from tokenmill.bench import agent_sessions, serve_cli, soak, sweep

    _add_subcommands(bench, "bench_command", [
        ("serve", "load-test an OpenAI-compatible server", serve_cli.add_args, serve_cli.main),
        ("agent-sessions", "multi-turn agents resending a growing history: TTFT and cache hits by turn",
         agent_sessions.add_args, agent_sessions.main),
        ("sweep", "the serving experiments: continuous vs static vs dynamic batching up to saturation, chunked "
         "prefill, prefix caching; a section of BENCHMARKS.md with plots (docs/ of a clone or --output)",
         sweep.add_args, sweep.main),
        ("soak", "drive a server with thousands of mixed requests, check it holds", soak.add_args, soak.main),
    ])


def _add_sim_commands(sim: argparse.ArgumentParser) -> None:
    from tokenmill.sim import calibrate
    from tokenmill.sim import cli as sim_cli

    _add_subcommands(sim, "sim_command", [
        ("run", "simulate a workload on a model and hardware preset", sim_cli.add_args, sim_cli.main),
        ("sweep", "vary one setting (request rate, batching, token budget, seqs)", sim_cli.add_sweep_args,
         sim_cli.sweep_main),
        ("capacity", "replicas needed for a target rate under SLOs", sim_cli.add_capacity_args,
         sim_cli.capacity_main),
        ("calibrate", "fit this CPU's profile to timed steps of the real engine", calibrate.add_args,
         calibrate.main),
    ])


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        from tokenmill.engine.process_start import start_core_server

        start_core_server()  # its imports run while this process imports its own
    from tokenmill.router.policy import ROUTERS

    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation on the engine")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--input", help="JSONL file: one {prompt | messages | prompt_token_ids} per line")
    gen.add_argument("--output", help="JSONL file for the results")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="GGUF file or HF directory, as `vllm serve MODEL` (same as --model)")
    serve.add_argument("--model-dir", default=None, metavar="DIR",
                       help="serve every GGUF file and HF model directory in DIR, named by file; each loads on its "
                            "first request")
    serve.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                       help="with several models: at most N loaded, the least recently used idle one unloaded "
                            "first (default: no limit)")
    serve.add_argument("--admin-api-key", default=os.environ.get("TOKENMILL_ADMIN_API_KEY"),
                       help="with several models: the key of the admin API (GET /admin/models, POST "
                            "/admin/models/NAME/reload {path}); off without one")
    serve.add_argument("--swap-min-agreement", type=float, default=0.5, metavar="SHARE",
                       help="a reloaded version serves only if it answers the probe prompts (--drift-probe, or a "
                            "few fixed ones) greedily with at least this share of the serving version's tokens")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"))
    serve.add_argument("--cache-salt-source", type=_cache_salt_source, default="request", metavar="SOURCE",
                       help="whose cache_salt a request gets (requests with different salts share no KV blocks): "
                            "request = the client's cache_salt field; api-key = the key it presented; "
                            "header:NAME = that header's value (a client's own cache_salt is added to the server's)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024,
                       help="larger request bodies get 413")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take from arrival to its last token (then 408); default none")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    serve.add_argument("--enable-log-requests", action="store_true", help="log each request's start and end")
    serve.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line in the log")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true")
    serve.add_argument("--step-trace", default=None, metavar="FILE",
                       help="append one JSON line per model step (its time and shape) for tokenmill sim calibrate")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": parse tool calls the model writes (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", choices=["auto", *PARSERS], default=None,
                       help="the format of the model's tool calls, by family (hermes: <tool_call>{...}</tool_call>, "
                            "Qwen2.5/3; llama3_json; mistral; qwen3_coder; pythonic; deepseek_v3); auto: the one "
                            "the chat template writes (also what forced calls use when this flag is not given)")
    serve.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send a span per request (queue, prefill and decode below it; the client's traceparent "
                            "continued) to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318/v1/traces (needs "
                            "pip install 'tokenmill[tracing]')")
    serve.add_argument("--drift-probe", default=None, metavar="FILE",
                       help="prompts (a JSON list or JSON lines: a string, token ids, or {prompt, max_tokens}) run "
                            "greedily every --drift-probe-interval minutes at the lowest priority; their tokens and "
                            "logprobs are compared with the answers at start (metrics tokenmill:drift_*, a warning "
                            "when they differ)")
    serve.add_argument("--drift-probe-interval", type=float, default=10.0, metavar="MINUTES",
                       help="minutes between drift checks (default 10)")
    serve.add_argument("--drift-logprob-tolerance", type=float, default=1e-3, metavar="NATS",
                       help="a probe token's logprob this far from its baseline counts as drift (default 1e-3: "
                            "float rounding across batch shapes stays under 1e-4)")
    serve.add_argument("--tool-call-parser-strict", action="store_true",
                       help="read only the format's exact form (hermes: no tagless or fenced JSON calls)")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="GET /tokenizer_info: the special tokens and chat template (lm-evaluation-harness's "
                            "remote tokenizer reads it)")
    serve.add_argument("--responses-store-size", type=int, default=1000,
                       help="Responses API: how many stored responses previous_response_id can continue (in memory, "
                            "least recently used evicted first; 0 stores none)")
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help='adapters to serve (PEFT directories): name=path or \'{"name": ..., "path": ...}\'')
    serve.add_argument("--enable-runtime-lora-updating", action="store_true",
                       help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (paths under --lora-dir)")
    serve.add_argument("--lora-dir", default=None,
                       help="the directory run-time adapter loads may read from")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine-core processes, each with its own model copy and KV cache; the CPUs are split "
                            "between them")
    serve.add_argument("--router", choices=ROUTERS, default="prefix-aware",
                       help="which engine core gets a request when there are several")
    serve.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                       help="mp: engine cores as local processes; ray: as Ray actors on a running Ray cluster "
                            "(pip install 'tokenmill[ray]')")
    serve.add_argument("--disaggregated", default=None, metavar="xPyD",
                       help="prefill/decode disaggregation: x prefill engines and y decode engines (e.g. 1P1D), "
                            "one process each, the CPUs split between them")
    serve.add_argument("--kv-transport", choices=["shm", "tcp"], default="shm",
                       help="how KV blocks move from prefill to decode engines: shared memory (one host) or TCP")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    sim = sub.add_parser("sim", help="the real scheduler on a simulated clock (cost model per step)")
    # The benchmark and simulator modules import the engine (and torch): only the command being run reads them,
    # so `tokenmill serve`'s front end stays torch-free.
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command == ["bench"]:
        _add_bench_commands(bench)
    elif command == ["sim"]:
        _add_sim_commands(sim)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

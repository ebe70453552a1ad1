"""This engine as an NVIDIA Dynamo worker: token ids in, token ids out, over the same engine thread as
Triton's `llm` model (backend/serving/engine_thread.py).

Dynamo's frontend tokenizes, applies the chat template, detokenizes and trims stop strings; the worker
turns its preprocessed request into a GenerationRequest (backend/dynamo/request.py), submits it to the
engine thread and streams each step's new tokens back. It registers the model with the pool's block size
and the context length, and feeds the KV-aware router (backend/dynamo/publisher.py). A client that goes
away aborts the engine request, which frees its KV blocks.

    python -m backend.dynamo.worker --model default --served-model-name SmolLM2-135M-Instruct

Every engine setting is a flag (`--max-num-seqs 64`, `--block-size 16`, ...), typed as in config.pbtxt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncGenerator, Callable
from typing import Any

from dynamo.common.backend import EngineConfig as RegisteredModel
from dynamo.common.backend import LlmRegistration, WorkerConfig
from dynamo.common.backend import LLMEngine as DynamoEngine
from dynamo.common.backend.publisher import ComponentSnapshot, PushSource
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.run import run
from dynamo.common.constants import DisaggregationMode
from dynamo.llm import FpmDirectPublisher
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

from backend.dynamo.args import worker_parser
from backend.dynamo.disagg import Disaggregation
from backend.dynamo.publisher import RouterFeed
from backend.dynamo.request import generation_request
from backend.engine import LLMEngine
from backend.engine.config import EngineConfig, setting_fields
from backend.engine.errors import EngineDeadError, InvalidRequestError
from backend.engine.sampling import Sampled
from backend.serving.engine_thread import EngineLoop, Submission
from backend.serving.settings import engine_config_from_settings
from backend.serving.tokenizer import load_tokenizer

LOG = logging.getLogger(__name__)
LORA_UPDATES = ("load_lora", "unload_lora", "list_loras")  # engine_update's keys: POST /engine/update/<key>
MODES = {"both": DisaggregationMode.AGGREGATED, "prefill": DisaggregationMode.PREFILL,
         "decode": DisaggregationMode.DECODE}


class EngineWorker(DynamoEngine):
    def __init__(self, config: EngineConfig, served_model_name: str, disagg: Disaggregation):
        self.config = config
        self.served_model_name = served_model_name
        self.disagg = disagg
        self.feed = RouterFeed(ComponentSnapshot)
        self.loop: EngineLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._endpoint: Any = None  # the serving endpoint (on_endpoint_ready), where LoRA adapters register
        self._in_flight = 0  # generate() calls not yet finished

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[EngineWorker, WorkerConfig]:
        args = worker_parser().parse_args(argv)
        settings = {name: value for name in setting_fields()
                    if (value := getattr(args, name)) is not None}
        settings["enable_kv_events"] = "true"
        engine_config = engine_config_from_settings(settings)  # resolves the model folder
        worker = cls(engine_config, args.served_model_name, Disaggregation(args.role, args.kv_transport, args.kv_host))
        config = WorkerConfig(  # the frontend reads the tokenizer and chat template from `model_name`, a folder
            namespace=args.namespace, component=args.component, endpoint="generate",
            model_name=engine_config.model, served_model_name=args.served_model_name,
            discovery_backend=args.discovery_backend, request_plane="tcp", event_plane=args.event_plane,
            disaggregation_mode=MODES[args.role], tool_call_parser=args.dyn_tool_call_parser,
            reasoning_parser=args.dyn_reasoning_parser)
        return worker, config

    async def start(self, worker_id: int) -> RegisteredModel:
        config = self.config
        tokenizer = load_tokenizer(config.model)
        # the loop thread builds the engine (see engine_thread.py); start() waits for it
        self.loop = await asyncio.to_thread(EngineLoop(lambda: LLMEngine(config), tokenizer, self.feed).start)
        engine = self.loop.engine
        await self.disagg.start()
        self._watchdog = asyncio.get_running_loop().create_task(self._stop_if_the_engine_dies())
        LOG.info("worker %s: %s engine on %s, %d KV blocks of %d, max_model_len %d", worker_id,
                 config.runtime, config.model, engine.kv.num_blocks, config.cache.block_size, engine.max_model_len)
        return RegisteredModel(
            model=config.model, served_model_name=self.served_model_name,
            llm=LlmRegistration(context_length=engine.max_model_len, kv_cache_block_size=config.cache.block_size,
                                total_kv_blocks=engine.kv.num_blocks,
                                max_num_seqs=config.scheduler.max_num_seqs,
                                max_num_batched_tokens=config.scheduler.max_num_batched_tokens))

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        """The forward-pass metrics publisher (what the planner reads), and each LoRA adapter (`lora_modules`)
        registered as a model of its own on this endpoint, as dynamo.vllm does: OpenAI's `model` names it, and the
        request arrives with that name (a model alias would arrive renamed)."""
        self._endpoint = endpoint
        self.feed.fpm = FpmDirectPublisher(endpoint, str(endpoint.connection_id()), dp_size=1)
        for name in sorted(self.loop.engine.list_loras()):
            await self._register_lora(name)

    async def _register_lora(self, name: str) -> None:
        from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

        if self.disagg.role != "both":
            raise InvalidRequestError("lora_name", "LoRA adapters are served by aggregated workers (--role both) for "
                                                   "now")
        engine = self.loop.engine
        runtime = ModelRuntimeConfig()
        runtime.context_length, runtime.total_kv_blocks = engine.max_model_len, engine.kv.num_blocks
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, self._endpoint,
                             self.config.model, kv_cache_block_size=self.config.cache.block_size,
                             runtime_config=runtime, user_data={"lora_adapter": True}, lora_name=name,
                             base_model_path=self.config.model, worker_type=WorkerType.Aggregated, ignore_weights=True)
        LOG.info("LoRA adapter %r registered as a model", name)

    def supported_updates(self) -> set[str]:
        return set(LORA_UPDATES)

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /engine/update/load_lora | unload_lora | list_loras on this worker's system port, with the body of
        Dynamo's /v1/loras ({"lora_name": ..., "source": {"uri": "file:///path"}}): load an adapter (or replace one no
        request uses) and register it as a model; unload one no request uses and unregister it; list them."""
        from dynamo.llm import unregister_model

        try:
            if update == "list_loras":
                loras = await asyncio.wrap_future(self.loop.call(lambda engine: engine.list_loras()))
                return {"status": "success", "loras": loras, "count": len(loras)}
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise InvalidRequestError("lora_name", f"expected an adapter name, got {name!r}")
            if update == "load_lora":
                uri = str((body.get("source") or {}).get("uri") or "")
                path = uri.removeprefix("file://")
                if not path or "://" in path:
                    raise InvalidRequestError("source.uri", f"a local folder (file:///path) is expected, got {uri!r}")
                await asyncio.wrap_future(self.loop.call(lambda engine: engine.load_lora(name, path)))
                await self._register_lora(name)
            else:
                await asyncio.wrap_future(self.loop.call(lambda engine: engine.unload_lora(name)))
                await unregister_model(self._endpoint, lora_name=name)
        except InvalidRequestError as err:
            return {"status": "error", "message": str(err)}
        return {"status": "success", "message": f"LoRA adapter {name!r} {update.split('_')[0]}ed", "lora_name": name}

    async def _stop_if_the_engine_dies(self) -> None:
        """A worker whose engine thread died must not stay registered: SIGTERM starts Dynamo's graceful
        shutdown, which unregisters it, so the frontend routes elsewhere (and the launcher says so)."""
        while self.loop is not None and self.loop.alive:
            await asyncio.sleep(0.5)
        if self.loop is not None:
            LOG.error("the engine died (%r); stopping this worker", self.loop.error)
            os.kill(os.getpid(), signal.SIGTERM)

    async def is_quiescent(self) -> bool | None:
        """Dynamo polls a stopping prefill worker (after its grace period, before cleanup) until this is True: its
        last requests are done and their exports fetched, so the decode workers on their way need not prefill again
        (the planner scaling prefill workers in). Other roles are not polled. Counted here, not by the loop's
        num_active, which drops before the finished request's export is put."""
        if self.disagg.server is None:
            return None
        return self._in_flight == 0 and self.disagg.server.num_pending == 0

    async def kv_event_sources(self) -> list[PushSource]:
        return [PushSource(on_ready=self._on_kv_publisher, dp_rank=0)]

    def _on_kv_publisher(self, publisher: Any) -> None:
        self.feed.kv_publisher = publisher

    async def register_prometheus(self, metrics: Any) -> None:
        register_engine_registry(metrics, self.disagg.registry)

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self.feed.snapshots = publisher

    async def generate(self, request: dict, context: Any) -> AsyncGenerator[dict, None]:
        engine = self.loop.engine
        try:
            req = generation_request(request, engine.model_config.eos_token_ids, engine.max_model_len,
                                     engine.list_loras(), self.served_model_name)
        except InvalidRequestError as err:
            raise InvalidArgument(str(err)) from None
        req, export = await self.disagg.prepare(request, req)
        aio = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:  # called on the engine's output thread
            aio.call_soon_threadsafe(outputs.put_nowait, item)

        sub = Submission(client_id=context.id(), request=req, emit=put, fail=put, is_cancelled=context.is_stopped,
                         on_kv_export=None if export is None else self.disagg.export_to(export))
        try:
            self.loop.submit(sub)
        except EngineDeadError as err:
            raise EngineShutdown(str(err)) from None
        finished, prompt_logprobs = False, None
        self._in_flight += 1
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    finished = True
                    raise _dynamo_error(out)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = _prompt_logprobs(out.prompt_logprobs, self.loop.tokenizer.decode)
                chunk: dict[str, Any] = {"token_ids": out.new_token_ids, "index": 0}
                if req.params.logprobs:
                    chunk["log_probs"] = out.new_logprobs
                if req.params.top_logprobs:  # as dynamo.sglang sends them: the frontend decodes each token's text
                    chunk["top_logprobs"] = [[{"rank": rank, "token_id": token, "token": None, "logprob": logprob}
                                              for rank, (token, logprob) in enumerate(top, 1)]
                                             for top in out.new_top_logprobs]
                if out.finished:
                    finished = True
                    chunk["finish_reason"] = out.finish_reason
                    chunk["completion_usage"] = {
                        "prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
                        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
                    if export is not None:  # a prefill's blocks, waiting for the decode worker (filled before this)
                        chunk["disaggregated_params"] = export
                    if prompt_logprobs is not None:  # as dynamo.vllm sends them: the frontend's nvext.prompt_logprobs
                        chunk["engine_data"] = {"prompt_logprobs": prompt_logprobs}
                yield chunk
        finally:
            self._in_flight -= 1
            if not finished:  # the stream was closed early (client gone): free the engine request
                self.loop.stop_request(sub.client_id)

    async def abort(self, context: Any) -> None:
        if self.loop is not None:
            self.loop.stop_request(context.id())

    async def cleanup(self) -> None:
        loop, self.loop = self.loop, None
        self.feed.kv_publisher = self.feed.snapshots = None
        fpm, self.feed.fpm = self.feed.fpm, None
        if loop is not None:
            await asyncio.to_thread(loop.shutdown)
        if fpm is not None:
            fpm.shutdown()
        await self.disagg.close()


def _prompt_logprobs(entries: list[Sampled], decode: Callable[[list[int]], str]
                     ) -> list[dict[str, dict[str, Any]] | None]:
    """The engine's prompt logprobs in dynamo.vllm's shape: per prompt position None (the first) or {token id as a
    string: {logprob, decoded_token}}, the prompt's token and then its likeliest alternatives."""
    positions: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        pairs = [(entry.token, entry.logprob)] + [pair for pair in entry.top_logprobs if pair[0] != entry.token]
        positions.append({str(token): {"logprob": logprob, "decoded_token": decode([token])} for token, logprob in pairs})
    return positions


def _dynamo_error(err: Exception) -> Exception:
    if isinstance(err, InvalidRequestError):
        return InvalidArgument(str(err))
    if isinstance(err, EngineDeadError):
        return EngineShutdown(str(err))
    return Unknown(f"{type(err).__name__}: {err}")


def main() -> None:
    run(EngineWorker)


if __name__ == "__main__":
    main()

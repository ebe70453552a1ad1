"""Triton glue for the engine (decoupled): token ids in and out, or text in and out in one hop (the clients'
default front door; no BLS, no ensemble). The logic lives in backend/serving (engine thread, request parsing)
and backend/triton (config, responses, metrics)."""

import gc
import json

import triton_python_backend_utils as pb_utils

from backend.engine import LLMEngine
from backend.serving.engine_thread import EngineLoop, Submission
from backend.serving.request import parse_request
from backend.serving.tokenizer import load_tokenizer
from backend.serving.settings import engine_config_from_settings
from backend.triton.glue import error_response, model_parameters, read_inputs, requested_outputs, tensors_response
from backend.triton.metrics import TritonMetrics
from backend.triton.responses import ResponseBuilder, Responses

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        self.input_names = [i["name"] for i in model_config["input"]]
        config = engine_config_from_settings(model_parameters(args))
        self.tokenizer = load_tokenizer(config.model)
        self.metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        # built on the loop's thread, the one that runs its forwards (see backend/serving/engine_thread.py)
        self.loop = EngineLoop(lambda: LLMEngine(config), self.tokenizer, self.metrics).start()
        self.engine = self.loop.engine
        pb_utils.Logger.log_info(f"llm: {config.runtime} engine on {config.model}, quantization "
                                 f"{self.engine.config.quantization}, "
                                 f"{self.engine.kv.num_blocks} KV blocks of {config.cache.block_size}, "
                                 f"max_model_len {self.engine.max_model_len}; outputs sent "
                                 f"{'beside the next step' if self.loop.overlap_outputs else 'between steps'}")

    def is_ready(self) -> bool:  # called by python backends that support it (not 2.51)
        return self.loop.alive

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = read_inputs(pb_utils, request, self.input_names)
                req = parse_request(inputs, self.tokenizer, self.engine.model_config.eos_token_ids)
                builder = ResponseBuilder(req, self.tokenizer)
                if req.stop:  # TensorRT-LLM's cancel: end the earlier request with this request id
                    self.loop.stop_request(request.request_id())
                    sender.send(tensors_response(pb_utils, builder.final_empty(), requested_outputs(request)),
                                flags=FINAL)
                    continue
                self.loop.submit(self._submission(request, sender, builder))
            except Exception as err:  # noqa: BLE001 - this request's error; the server serves on
                sender.send(error_response(pb_utils, err), flags=FINAL)
        return None

    @staticmethod
    def _submission(request, sender, builder: ResponseBuilder) -> Submission:
        requested = requested_outputs(request)
        responses = Responses(builder)

        def emit(out):
            tensors = responses.build(out)
            if tensors is not None:
                sender.send(tensors_response(pb_utils, tensors, requested),
                            flags=FINAL if out.request_finished else 0)

        return Submission(client_id=request.request_id(), request=builder.request, emit=emit,
                          fail=lambda err: sender.send(error_response(pb_utils, err), flags=FINAL),
                          is_cancelled=sender.is_cancelled)

    def finalize(self):
        self.loop.shutdown()
        # The metric families go while the stub still talks to the server: each one's destructor is a message to
        # it, and left to the interpreter's exit they segfaulted the stub at every stop (Triton 2.51).
        del self.loop, self.engine, self.metrics
        gc.collect()


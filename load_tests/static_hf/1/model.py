"""Triton glue for bench_online's static-batching baseline: text -> ids -> StaticBatcher -> streamed text.

Every request generates exactly max_tokens tokens (EOS is suppressed), so `ignore_eos: false` is refused.
"""

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM

from backend.serving.detokenize import IncrementalDetokenizer
from backend.engine.sampling import SamplingParams
from backend.serving.request import parse_text_prompt
from backend.engine.errors import InvalidRequestError
from backend.serving.tokenizer import encode, load_tokenizer
from backend.serving.model_store import resolve_model_dir
from load_tests.static_batcher import Job, StaticBatcher

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        model_dir = resolve_model_dir(params["model"])
        self.tokenizer = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, params["dtype"])).eval()
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.batcher = StaticBatcher(model, pad_id, int(params["max_batch"]))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.batcher.submit(self._job(request, sender))
            except InvalidRequestError as err:
                error = pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        return None

    def _job(self, request, sender) -> Job:
        def value(name, default):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return tensor.as_numpy().reshape(-1)[0].item() if tensor is not None else default

        if not value("ignore_eos", True):
            raise InvalidRequestError("ignore_eos", "static_hf always generates max_tokens tokens")
        tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
        text = parse_text_prompt({"text_input": None if tensor is None else tensor.as_numpy()}).text
        prompt = encode(self.tokenizer, text, apply_chat_template=bool(value("apply_chat_template", False)))
        max_tokens = int(value("max_tokens", SamplingParams().max_tokens))
        if max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {max_tokens}")
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        count_tokens = bool(value("return_num_output_tokens", False))

        def emit(new_ids, final):
            text = detokenizer.push(new_ids, final)
            tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
            if count_tokens:
                count = np.array([[len(detokenizer.ids)]], dtype=np.int32)
                tensors.append(pb_utils.Tensor("num_output_tokens", count))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)

        def fail(err):
            error = pb_utils.TritonError(f"static_hf: {err}", pb_utils.TritonError.INTERNAL)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

        return Job(prompt, max_tokens, emit, fail)

    def finalize(self):
        self.batcher.close()

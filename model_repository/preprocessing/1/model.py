"""Triton glue: text_input -> input_ids with the model's tokenizer (backend/serving/tokenizer.py)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.request import TEXT_INPUTS, parse_text_prompt
from backend.serving.tokenizer import encode
from backend.triton.glue import error_response, model_tokenizer, read_inputs


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prompt = parse_text_prompt(read_inputs(pb_utils, request, list(TEXT_INPUTS)))
                ids = encode(self.tokenizer, prompt.text, prompt.apply_chat_template) if prompt.text else []
                out = pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as err:  # noqa: BLE001 - this request's error; the model serves on
                responses.append(error_response(pb_utils, err))
        return responses


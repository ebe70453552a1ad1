"""Triton glue: text_input -> input_ids with the model's tokenizer (backend/serving/tokenizer.py)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.request import parse_text
from backend.serving.tokenizer import encode
from backend.triton.glue import error_response, model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                flag = lambda name: _flag(request, name)  # noqa: E731
                text = parse_text(pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy(),
                                  allow_empty=flag("stop"))
                ids = encode(self.tokenizer, text, apply_chat_template=flag("apply_chat_template")) if text else []
                out = pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as err:  # noqa: BLE001 - this request's error; the model serves on
                responses.append(error_response(pb_utils, err))
        return responses


def _flag(request, name: str) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])

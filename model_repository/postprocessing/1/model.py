"""Triton glue: (context_ids, output_ids, is_final) -> text_output via backend/serving/detokenize.py."""

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.serving.detokenize import decode_delta
from backend.triton.glue import model_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = model_tokenizer(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            ids, context, final = (pb_utils.get_input_tensor_by_name(request, n).as_numpy().reshape(-1)
                                   for n in ("output_ids", "context_ids", "is_final"))
            text = decode_delta(self.tokenizer, context.tolist(), ids.tolist(), bool(final[0]))
            out = pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

"""--dump with images: the pixels (megabytes) are recorded as their shape and content hashes."""

from __future__ import annotations

import json

import numpy as np

from backend.contract import GenerationRequest
from backend.contract.vision import VisionItem
from openai_frontend.operations.dump import RequestDump


def test_a_dump_records_pixels_as_shape_and_hashes(tmp_path):
    items = tuple(VisionItem("image", (1, 4, 4), np.full((16, 1176), i, np.float32)) for i in range(2))
    dump = RequestDump(tmp_path, "chatcmpl-1", "chat", {"messages": []})
    dump.tensors(GenerationRequest([1, 2, 3], vision=items))
    dump.response("{}")
    record = json.loads((tmp_path / "chatcmpl-1.json").read_text())["tensors"][0]
    assert record["vision_pixels"] == {"shape": [32, 1176], "content_hashes": [i.content_hash for i in items]}
    assert record["vision_grids"] == [[1, 4, 4], [1, 4, 4]] and record["prompt_tokens"] == [1, 2, 3]

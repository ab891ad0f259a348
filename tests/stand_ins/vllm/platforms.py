"""vLLM's `current_platform`: the stand-in runs where the trainer does, on CPU
(VLLM_STAND_IN_DEVICE names another, to check the refusal)."""

import os
from types import SimpleNamespace

current_platform = SimpleNamespace(device_type=os.environ.get("VLLM_STAND_IN_DEVICE", "cpu"))

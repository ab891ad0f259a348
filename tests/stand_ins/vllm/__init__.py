"""A stand-in for vLLM with the interface finetune's vllm engine uses (TRL's
colocate mode's): `LLM(model=DIR, ...)`, `generate` on token-id prompts with
per-request seeds and the sampled tokens' log-probs, `sleep` / `wake_up`,
`reset_prefix_cache` and the model's `load_weights`. It samples with
transformers on CPU, so the suite can run the engine's weight sync and sleep
logic where vLLM's CPU build does not install.

It holds the real engine's rules that the trainer must keep: `generate` while
the KV cache sleeps, or `load_weights` while the weights sleep, raises; sleep
level 2 discards the weights (NaN), so sampling from weights that were not
loaded again shows up as garbage. Its log-probs are of the temperature-scaled
logits in float64, so they differ from the trainer's float32 ones by rounding
alone (as a real engine's kernels make them differ by more).

Each call is appended to the file $VLLM_STAND_IN_LOG names (one JSON line),
for the tests to read what the trainer asked of it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

__version__ = "0.0.0-stand-in"


def record(**event) -> None:
    path = os.environ.get("VLLM_STAND_IN_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "pid": os.getpid(), **event}) + "\n")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class StandInModel:
    """vLLM's model as its runner holds it: `load_weights` takes checkpoint names."""

    def __init__(self, hf_model: torch.nn.Module, llm: "LLM"):
        self.hf_model, self.llm = hf_model, llm

    def load_weights(self, weights) -> set[str]:
        if self.llm.asleep["weights"]:
            raise RuntimeError("load_weights while the weights sleep: wake_up(tags=['weights']) first")
        tensors = dict(self.hf_model.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if name not in tensors:
                raise KeyError(f"the stand-in model has no weight {name}")
            with torch.no_grad():
                tensors[name].copy_(tensor)
            loaded.add(name)
        self.llm.loaded_since_sleep |= loaded
        return loaded


class LLM:
    def __init__(self, model: str, gpu_memory_utilization: float = 0.9, enable_sleep_mode: bool = False,
                 seed: int = 0, dtype: str = "auto", **kwargs):
        from transformers import AutoModelForCausalLM

        if kwargs.get("distributed_executor_backend") != "external_launcher":
            raise ValueError("the stand-in runs in the trainer's processes only (external_launcher)")
        self.hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.enable_sleep_mode = enable_sleep_mode
        self.asleep = {"weights": False, "kv_cache": False}
        self.loaded_since_sleep: set[str] = set()
        runner = SimpleNamespace(model=StandInModel(self.hf_model, self))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=runner)))
        record(event="start", argv=sys.argv, model=model, gpu_memory_utilization=gpu_memory_utilization,
               enable_sleep_mode=enable_sleep_mode, dtype=dtype, **{k: str(v) for k, v in kwargs.items()})

    def sleep(self, level: int = 1) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep mode was not enabled")
        self.asleep = {"weights": True, "kv_cache": True}
        if level == 2:  # the weights are discarded: they must be loaded again
            with torch.no_grad():
                for p in self.hf_model.parameters():
                    p.fill_(float("nan"))
            self.loaded_since_sleep = set()
        record(event="sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or ["weights", "kv_cache"]:
            self.asleep[tag] = False
        record(event="wake_up", tags=tags)

    def reset_prefix_cache(self) -> None:
        record(event="reset_prefix_cache", loaded=len(self.loaded_since_sleep))

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[RequestOutput]:
        if self.asleep["kv_cache"] or self.asleep["weights"]:
            raise RuntimeError(f"generate while asleep: {self.asleep}")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            generator = torch.Generator().manual_seed(p.seed if p.seed is not None else 0)
            tokens, logprobs, past = [], [], None
            step_input = torch.tensor([ids])
            for _ in range(p.max_tokens):
                out = self.hf_model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].double()
                if p.temperature == 0:
                    token = int(logits.argmax())
                    logps = torch.log_softmax(logits, -1)
                else:
                    logps = torch.log_softmax(logits / p.temperature, -1)
                    probs = logps.exp()
                    if p.top_p < 1.0:
                        order = probs.argsort(descending=True)
                        keep = probs[order].cumsum(0) - probs[order] < p.top_p
                        probs = torch.zeros_like(probs).scatter(0, order[keep], probs[order][keep])
                    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
                tokens.append(token)
                logprobs.append({token: Logprob(float(logps[token]))})
                if token in p.stop_token_ids:
                    break
                step_input = torch.tensor([[token]])
            outputs.append(RequestOutput(ids, [CompletionOutput(tokens, logprobs)]))
        record(event="generate", requests=len(prompts), finite=bool(all(
            torch.isfinite(torch.tensor([next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])).all()
            for o in outputs)))
        return outputs

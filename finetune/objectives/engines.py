"""Where a rollout's completions are sampled (--generation_engine).

- `sharded`: the policy as the backend holds it. Under FSDP2 and ZeRO-3 every
  forward gathers each layer's parameters from the other ranks, token by token,
  and every rank runs as many forwards as the longest completion needs.
- `replica`: one unsharded copy of the policy per rank, for sampling only, in
  the dtype the trained model computes in. Before a sampling that follows an
  optimizer step, its weights are refreshed from the trained ones, one tensor
  at a time (each briefly whole on every rank); under LoRA only the adapters,
  the frozen base once. Sampling then gathers nothing and each rank stops at
  its own longest completion.
- `auto`: `vllm` where vLLM is installed and runs on the trainer's device,
  else `replica` where the backend shards the model and a whole copy fits in
  half of the memory left beside training, else `sharded`.

- `vllm` (vllm_engine.py): vLLM's engine in each rank's process (TRL's
  colocate mode), the trained weights loaded into it before each sampling
  that follows an optimizer step. Its kernels are not the trainer's, so the
  trainer's log-probs of what it sampled differ a little from the engine's;
  the loss corrects for that with truncated importance sampling.

`sharded` and `replica` sample the same completions: the same seeds, the
same weights in the same dtype, the same `generate`.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from accelerate import Accelerator

from finetune.backends.base import Backend


@dataclass(frozen=True)
class Sampling:
    """What every engine samples with."""
    max_new_tokens: int
    temperature: float
    top_p: float
    eos_token_id: int
    pad_token_id: int
    greedy: bool = False
    never: tuple[int, ...] = ()  # tokens never sampled (a VLM's image placeholders: a completion holds no image)


@dataclass
class Sampled:
    ids: torch.Tensor                  # [N, <= max_new_tokens] completions, padded after the end-of-text token
    logps: torch.Tensor | None = None  # [N, same] the engine's log-prob of each sampled token (None: the trainer's own)


class AsHeld:
    """The policy as the backend holds it."""
    name: ClassVar[str] = "sharded"

    def __init__(self, accelerator: Accelerator, backend: Backend, cfg=None):
        self.accelerator, self.backend = accelerator, backend
        self.sync_seconds = 0.0  # spent syncing weights into the engine since take_seconds last read it

    def take_seconds(self) -> float:
        spent, self.sync_seconds = self.sync_seconds, 0.0
        return spent

    def weights_changed(self) -> None:
        """The trained weights are about to move (an optimizer step): nothing to do, they are sampled from."""

    def sample(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               sampling: Sampling, inputs: dict | None = None) -> Sampled:
        """Completions of left-padded prompts with transformers' `generate`,
        from the seeded torch RNG; `inputs`: what else the model reads of the
        prompts (a vision-language model's pixels, image grids)."""
        generator, synced, around = self.generator(model)
        options = ({"do_sample": False} if sampling.greedy else
                   {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0})
        if sampling.never:
            options["suppress_tokens"] = list(sampling.never)
        with torch.no_grad(), around:
            out = generator.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                     max_new_tokens=sampling.max_new_tokens, min_new_tokens=0,
                                     pad_token_id=sampling.pad_token_id, eos_token_id=sampling.eos_token_id,
                                     use_cache=True, synced_gpus=synced, **options, **(inputs or {}))
        return Sampled(out[:, prompt_ids.size(1):])

    def generator(self, model: torch.nn.Module):
        """(the module whose `generate` samples, whether ranks generate in step, the context around it)."""
        return (self.accelerator.unwrap_model(model), self.accelerator.num_processes > 1,
                self.backend.generating(model))


class Replica(AsHeld):
    """A whole copy of the policy on each rank, refreshed from the trained weights."""
    name = "replica"

    def __init__(self, accelerator: Accelerator, backend: Backend, cfg=None):
        super().__init__(accelerator, backend)
        self.copy: torch.nn.Module | None = None
        self.stale = True

    def weights_changed(self) -> None:
        self.stale = True

    def generator(self, model: torch.nn.Module):
        if self.stale:  # every rank samples at the same points, so every rank refreshes together
            started = time.perf_counter()
            self.refresh(model)
            self.sync_seconds += time.perf_counter() - started
            self.stale = False
        return self.copy, False, nullcontext()

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> None:
        policy = self.accelerator.unwrap_model(model)
        first = self.copy is None
        if first:  # built whole: ZeRO-3 would partition a model built while it is active (vision towers' are)
            with self.backend.models_built_whole(self.accelerator):
                self.copy = empty_like(policy)
        dtype, device = self.backend.sampling_dtype(policy), self.accelerator.device
        moving = {name for name, p in policy.named_parameters() if p.requires_grad}
        for name, tensor in self.backend.whole_parameters(policy, lambda n: first or n in moving):
            put(self.copy, plain_name(name), tensor.to(device=device, dtype=dtype))
        if first:
            for name, buffer in policy.named_buffers():
                if has_tensor(self.copy, plain_name(name)):
                    put(self.copy, plain_name(name), buffer.to(device))
            base = self.copy.get_base_model() if hasattr(self.copy, "get_base_model") else self.copy
            base.tie_weights()
            left = [name for name, p in self.copy.named_parameters() if p.device.type == "meta"]
            if left:
                raise RuntimeError(f"the sampling replica got no weights for {', '.join(left[:5])}")
            self.copy.eval().requires_grad_(False)


def put(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """`value` into the replica's tensor `name`: copied into it where it is
    already there, else set as a copy of its own (never the trained tensor)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    table = module._parameters if leaf in module._parameters else module._buffers
    held = table[leaf]
    if held is not None and held.device.type != "meta" and held.shape == value.shape:
        held.copy_(value)
    elif table is module._parameters:
        table[leaf] = torch.nn.Parameter(value.clone(), requires_grad=False)
    else:
        table[leaf] = value.clone()


def empty_like(policy: torch.nn.Module) -> torch.nn.Module:
    """The policy's architecture (its adapters included), its parameters on the
    meta device and its buffers real (rotary frequencies are computed, not loaded)."""
    from accelerate import init_empty_weights

    adapted = hasattr(policy, "peft_config")
    base = policy.get_base_model() if adapted else policy
    cls = original_class(base)
    # Some models draw from the RNG as they are built (vision towers' extra parameters): the
    # replica is first built inside a rollout's seeded sampling, whose draws must not move.
    with torch.random.fork_rng(devices=[]), init_empty_weights():
        model = cls(copy.deepcopy(base.config))
        if adapted:
            from peft import get_peft_model

            model = get_peft_model(model, copy.deepcopy(policy.peft_config[policy.active_adapter]))
    return model


def original_class(module: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps in a subclass of it at fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def plain_name(name: str) -> str:
    """A parameter's name without what wrappers (activation checkpointing) put in it."""
    return name.replace("_checkpoint_wrapped_module.", "")


def has_tensor(module: torch.nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    try:
        sub = module.get_submodule(owner) if owner else module
    except AttributeError:
        return False
    return leaf in sub._buffers or leaf in sub._parameters


def gigabytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

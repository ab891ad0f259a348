"""vLLM's engine in each rank's process (TRL's colocate mode: --generation_engine vllm).

Each rank starts its own `vllm.LLM` on its device, on the model's dir, with
`distributed_executor_backend="external_launcher"` (the ranks already form
the process group) and --vllm_gpu_memory_utilization of the device's memory
for its weights and KV cache. Before a sampling that follows an optimizer
step, the trained weights go into it with its model's own `load_weights`,
one tensor at a time, whole on every rank (gathered as the replica's are);
under LoRA the adapted layers' merged weights. With
--vllm_enable_sleep_mode the engine sleeps at level 2 while the trainer
steps (weights and KV cache freed) and wakes to sample, its weights loaded
again first.

Sampling is seeded per completion, from the rollout's seeded torch RNG, so a
resume draws the same seeds. The engine's kernels are not the trainer's: it
returns its log-prob of each sampled token, and the rollout weighs the loss
by the trainer's over the engine's (grpo_loss.engine_importance).
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch
from accelerate import Accelerator

from finetune.backends.base import Backend
from finetune.errors import UsageError
from finetune.objectives.engines import AsHeld, Sampled, Sampling, gigabytes, plain_name


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def refusal_or_reason(accelerator: Accelerator, asked: bool) -> str:
    """Why vLLM runs here (the start line's reason), or a one-line refusal:
    vLLM must be installed and built for the trainer's device."""
    if not installed():
        raise UsageError("--generation_engine vllm needs vLLM, which is not installed here; pip install vllm where the "
                         "GPUs are, or pass --generation_engine auto")
    from vllm.platforms import current_platform

    built_for, trains_on = current_platform.device_type or "no device", accelerator.device.type
    if built_for != trains_on:
        raise UsageError(f"vLLM here runs on {built_for} and this run trains on {trains_on}: vLLM's engine must share "
                         "the trainer's device; install the vLLM build for it, or pass --generation_engine auto")
    return "as asked" if asked else f"vLLM is installed for {trains_on}"


class VLLMColocate(AsHeld):
    name = "vllm"

    def __init__(self, accelerator: Accelerator, backend: Backend, cfg=None):
        super().__init__(accelerator, backend)
        self.cfg = cfg
        self.llm = None
        self.stale = True            # the trained weights moved since they were last loaded
        self.weights_asleep = False  # sleep level 2 freed the engine's weights

    def weights_changed(self) -> None:
        self.stale = True

    def start(self, policy: torch.nn.Module) -> None:
        from vllm import LLM

        cfg, acc = self.cfg, self.accelerator
        check_mergeable(policy)
        check_fits(acc.device, cfg.vllm_gpu_memory_utilization)
        # vLLM's external launcher joins the ranks' process group from the launcher's variables.
        os.environ.update(RANK=str(acc.process_index), LOCAL_RANK=str(acc.local_process_index),
                          WORLD_SIZE=str(acc.num_processes))
        self.llm = LLM(model=cfg.model, dtype=str(self.backend.sampling_dtype(policy)).removeprefix("torch."),
                       gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, max_model_len=cfg.block_size,
                       enable_sleep_mode=cfg.vllm_enable_sleep_mode, distributed_executor_backend="external_launcher",
                       seed=acc.process_index, logprobs_mode="processed_logprobs",
                       trust_remote_code=cfg.trust_remote_code, max_num_batched_tokens=4096)
        if cfg.vllm_enable_sleep_mode:
            self.llm.sleep(level=2)
            self.weights_asleep = True

    def sample(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               sampling: Sampling, inputs: dict | None = None) -> Sampled:
        from vllm import SamplingParams

        assert not inputs, "choose_engine never picks vLLM for prompts with images"

        policy = self.accelerator.unwrap_model(model)
        if self.llm is None:
            self.start(policy)
        sleeping = self.cfg.vllm_enable_sleep_mode
        if self.stale or self.weights_asleep:
            started = time.perf_counter()
            if self.weights_asleep:
                self.llm.wake_up(tags=["weights"])
                self.weights_asleep = False
            self.load(policy)
            self.sync_seconds += time.perf_counter() - started
            self.stale = False
        if sleeping:
            self.llm.wake_up(tags=["kv_cache"])
        # One seed per completion, drawn from the rollout's seeded RNG: the same draws on a resume.
        seeds = torch.randint(2**31 - 1, (len(prompt_ids),)).tolist()
        requests = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        params = [SamplingParams(n=1, max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0,
                                 stop_token_ids=[sampling.eos_token_id],
                                 **({"temperature": 0.0} if sampling.greedy else
                                    {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": -1}))
                  for seed in seeds]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        if sleeping:
            self.llm.sleep(level=2)
            self.weights_asleep = True
        completions = [out.outputs[0] for out in outputs]
        width = max(1, max(len(c.token_ids) for c in completions))
        ids = torch.full((len(completions), width), sampling.pad_token_id, dtype=torch.long)
        logps = torch.zeros((len(completions), width), dtype=torch.float32)
        for i, c in enumerate(completions):
            ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            logps[i, :len(c.token_ids)] = torch.tensor([step[token].logprob for step, token in
                                                        zip(c.logprobs, c.token_ids)])
        device = prompt_ids.device
        return Sampled(ids.to(device), logps.to(device))

    @torch.no_grad()
    def load(self, policy: torch.nn.Module) -> None:
        """The trained weights into the engine, each whole on every rank (a collective), under LoRA merged."""
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        dtype = self.backend.sampling_dtype(policy)
        for name, tensor in merged_weights(policy, self.backend.whole_parameters(policy, lambda n: True)):
            engine_model.load_weights([(name, tensor.to(dtype))])
        self.llm.reset_prefix_cache()


def merged_weights(policy: torch.nn.Module, whole):
    """(checkpoint name, tensor) of the model as `from_pretrained` names it:
    wrappers' prefixes gone, and under LoRA each adapted layer's base weight
    with its adapters merged in (W + scaling * B @ A), the adapters not sent."""
    adapter = getattr(policy, "active_adapter", None)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in whole:
        name = plain_name(name).removeprefix("base_model.model.")
        if adapter is None:
            yield name, tensor
            continue
        if ".lora_" not in name and ".base_layer." not in name:
            yield name, tensor
            continue
        if ".base_layer.bias" in name:
            yield name.replace(".base_layer.", "."), tensor
            continue
        module = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
        if ".lora_" in name and f".{adapter}." not in name:
            continue  # an adapter not in use
        parts = pending.setdefault(module, {})
        parts["base" if ".base_layer." in name else "A" if ".lora_A." in name else "B"] = tensor
        if len(parts) == 3:
            layer = policy.get_submodule(f"base_model.model.{module}")
            delta = parts["B"].float() @ parts["A"].float() * layer.scaling[adapter]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            yield f"{module}.weight", (parts["base"].float() + delta).to(parts["base"].dtype)
            del pending[module]
    if pending:
        raise RuntimeError(f"adapted layers without all of their weights: {', '.join(sorted(pending))[:200]}")


def check_mergeable(policy: torch.nn.Module) -> None:
    """`merged_weights` merges plain LoRA on linear layers (W + scaling * B @ A);
    anything else (DoRA, adapters on embeddings or on a mixture of experts'
    fused expert weights) is refused in one line before the engine starts."""
    adapter = getattr(policy, "active_adapter", None)
    if adapter is None:
        return
    from peft.tuners.lora import layer as lora

    for name, module in policy.named_modules():
        if not isinstance(module, lora.LoraLayer) or adapter not in module.lora_A:
            continue
        if not isinstance(module, lora.Linear) or isinstance(module, lora.ParamWrapper) or \
                module.use_dora.get(adapter, False):
            raise UsageError(f"--generation_engine vllm loads each adapted layer's weight with its LoRA adapters "
                             f"merged, and {name.removeprefix('base_model.model.')} holds another kind "
                             f"({type(module).__name__}); pass --generation_engine auto, or LoRA target modules "
                             "that are linear layers")


def check_fits(device: torch.device, utilization: float) -> None:
    """vLLM takes `utilization` of the device's whole memory; refused in one line where less is free."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if utilization * total > free:
        raise UsageError(f"--vllm_gpu_memory_utilization {utilization} asks vLLM for {gigabytes(int(utilization * total))} "
                         f"of this GPU and {gigabytes(free)} is free beside training; pass at most "
                         f"{free / total:.2f}, or --generation_engine auto")

"""Next-token cross-entropy, with or without the full [batch, block, vocab] logits.

The output layer turns every position's final hidden state into vocabulary
scores. For GPT-2 at 4 x 512 tokens those logits, their fp32 copy and their
gradient take about 1.2 GB, the largest tensors of a training step.
`chunked_head_loss` never builds them: it takes the output layer's *input* and
computes the loss a chunk of positions at a time, together with the gradients
of the hidden states and of the layer's weight (as fused linear-cross-entropy
kernels do). A chunk's logits die with it; backward only scales the stored
gradients, so it needs neither the logits nor the weight again.

It runs inside the model's own forward, through hooks on its output layer:
there FSDP has gathered the layer's weight, autocast is active, and everything
before the head (final norm, projections, the packing mask) is the model's
own. The model itself computes the head for the last position only and gets
back our logits for it, which keeps its output in the autograd graph (FSDP
runs its root pre-backward hook from there) and lets us check that the model
does nothing to its logits after the output layer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.errors import UsageError

IGNORE = -100
# Config attributes of families that transform their logits after the output
# layer (Gemma 2/3 soft-capping, Cohere, Granite and Falcon-H1 scaling): the
# chunked loss would not see that, so these use the full logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Targets for every position: the next token's label, ignored (-100) at
    the last. Shifting the targets instead of the logits spares a copy of the
    logits."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def full_logits_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL [B, T] from the model's logits, 0 where there is no
    target; in fp32 whatever the compute dtype (bf16 logits would quantise the loss)."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return nll.view(targets.shape)


def completion_logits(model: torch.nn.Module, inputs: dict,
                      targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits and the targets from the batch's first position with
    a target on: the prompts before it cost no [tokens, vocab] scores (the
    model's `logits_to_keep`, as TRL's trainers score completions). Every
    position for a model that does not take that argument."""
    labelled = (targets != IGNORE).any(dim=0).nonzero()
    first = int(labelled[0]) if len(labelled) else 0
    if first == 0 or not takes_logits_to_keep(model):
        return model(**inputs).logits, targets
    return model(**inputs, logits_to_keep=targets.shape[1] - first).logits, targets[:, first:]


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    inner = unwrapped(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # under adapters
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP (.module) or torch.compile (._orig_mod)."""
    while isinstance(inner := getattr(model, "module", None) or getattr(model, "_orig_mod", None), torch.nn.Module):
        model = inner
    return model


def can_chunk(model: torch.nn.Module) -> bool:
    """A linear output layer whose scores the model uses as they are, and
    whole on each rank once gathered (not split over tensor-parallel ranks,
    whose hooks gather its scores instead)."""
    inner = unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    transforms = [name for name in LOGIT_TRANSFORMS if getattr(inner.config, name, None) not in (None, 1, 1.0)]
    split = getattr(head, "_is_hooked", False)  # transformers' tensor-parallel plan put its hooks on it
    return isinstance(head, torch.nn.Linear) and not transforms and not split


class LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T + bias, targets), and
    the per-row NLL (not differentiable), a chunk of rows at a time. With
    `with_grads`, the gradients are computed in the same pass and kept for
    backward, which multiplies them by the incoming scalar gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, with_grads: bool):
        need_hidden, need_weight, need_bias = (with_grads and n for n in ctx.needs_input_grad[:3])
        nll = hidden.new_empty(len(hidden), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, len(hidden), chunk_size):
            rows = slice(start, start + chunk_size)
            h, t = hidden[rows], targets[rows]
            logits = F.linear(h, weight, bias)  # in autocast's dtype when autocast is on
            # From here on one [chunk, vocab] fp32 buffer, worked on in place:
            # scores, then exp(scores - max), then the softmax.
            scores = logits.float()
            target_scores = scores.gather(1, t[:, None]).squeeze(1)
            peak = scores.amax(dim=-1, keepdim=True)
            exp = scores.sub_(peak).exp_()
            sum_exp = exp.sum(dim=-1)
            nll[rows] = peak.squeeze(1) + sum_exp.log() - target_scores
            if not (need_hidden or need_weight or need_bias):
                continue
            # d nll / d logits = softmax - one_hot(target)
            grad_logits = exp.div_(sum_exp[:, None])
            grad_logits[torch.arange(len(t), device=t.device), t] -= 1
            # Back in the logits' dtype, as autograd would have it; these matmuls
            # run in the dtype the forward one did (autocast casts as it did there).
            grad_logits = grad_logits.to(logits.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:  # accumulated in fp32, in place where the dtypes allow
                if grad_logits.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight += grad_logits.t() @ h
            if need_bias:
                grad_bias += grad_logits.float().sum(dim=0)
        ctx.mark_non_differentiable(nll)
        # Not save_for_backward: these are results, not inputs, and backward
        # scales them in place and hands them on (a copy would be as large as the weight).
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return nll.sum(), nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_nll):
        grads, ctx.grads = ctx.grads, None  # only the returned tensors hold them now
        scaled = [None if g is None else g.mul_(grad_total).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        del grads
        return (*scaled, None, None, None)


@dataclass
class HeadLoss:
    """What one forward through the output layer's hooks produced."""
    total: torch.Tensor | None = None        # summed NLL over the positions with a target (differentiable)
    nll: torch.Tensor | None = None          # per-position NLL [B, T], 0 where there is no target
    last_logits: torch.Tensor | None = None  # the output layer's scores for the last position


def chunked_head_loss(model: torch.nn.Module, inputs: dict, targets: torch.Tensor,
                      chunk_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's forward with the loss taken at its output layer: (summed
    NLL, per-position NLL [B, T]), or None when the model did not run its
    output layer once on [B, T, width] (the caller then uses the full logits)."""
    head = unwrapped(model).get_output_embeddings()
    found = HeadLoss()

    def take_input(module, args):
        hidden = args[0]
        if found.total is not None or hidden.shape[:-1] != targets.shape:
            return None  # not the shape we know: leave the model alone
        rows = targets.reshape(-1) != IGNORE  # positions without a target cost nothing
        found.total, nll = LinearCrossEntropy.apply(hidden.reshape(-1, hidden.size(-1))[rows], module.weight,
                                                    module.bias, targets.reshape(-1)[rows], chunk_size,
                                                    torch.is_grad_enabled())
        found.nll = nll.new_zeros(targets.numel()).masked_scatter_(rows, nll).view(targets.shape)
        return (hidden[..., -1:, :],)  # the model's own head runs on the last position only

    def keep_output(module, args, output):
        if found.last_logits is None and found.total is not None:
            found.last_logits = NoGradient.apply(output)
            return found.last_logits
        return None

    handles = [head.register_forward_pre_hook(take_input), head.register_forward_hook(keep_output)]
    try:
        logits = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    if found.last_logits is None:
        return None
    if not same_scores(logits, found.last_logits):
        raise UsageError("this model changes its scores after its output layer, which the chunked loss does not "
                         "reproduce; train it with --loss_chunk_size 0 (the full logits)")
    # Empty, so exactly 0: it keeps the model's output in the graph, where FSDP
    # hooks its pre-backward step.
    return found.total + logits.flatten()[:0].sum(), found.nll


def same_scores(returned: torch.Tensor, ours: torch.Tensor) -> bool:
    """Exactly equal (a NaN equals a NaN: diverged weights are the loop's to
    report, as a non-finite loss), whatever dtype the model returns them in."""
    return returned is ours or (returned.shape == ours.shape and torch.allclose(
        returned.float(), ours.float(), rtol=0, atol=0, equal_nan=True))


class NoGradient(torch.autograd.Function):
    """A copy that takes part in the graph but passes no gradient back: the
    loss already holds the head's gradients, and the last position's scores
    would only add a second [vocab, width] weight gradient of zeros."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return None

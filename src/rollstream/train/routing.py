"""Routing replay in the trainer: the experts a mixture-of-experts forward pass sends each
token to, and how often the trainer's own router agrees with the engine's.

A forward hook on every router (a Qwen2-MoE ``mlp.gate``: it returns router logits, top-k
weights and top-k expert ids) sees the router's own choice. While a micro-batch's recorded
routing is bound (:meth:`RouterHooks.bind`), the hook counts, per (token, layer) with a
recorded routing, whether the router's own top-k set equals it, and with ``replay`` returns
the recorded experts in place of its own: their weights are the router's float32 softmax at
them, renormalised when the model's ``norm_topk_prob`` says so, then cast as the router casts
them (R3: the router's logits keep their gradient through the weights of the replayed
experts). Tokens without a recorded routing keep the router's own choice. The experts block
that follows computes exactly what it computes for its own choice, so where the two agree
the forward is bit-for-bit the unreplayed one.

Recorded routing comes from ``Sample.routing`` (:func:`routing_ids`), laid out like the
micro-batch's ``input_ids`` by ``batching.collate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from rollstream.trajectory import Routing


def routing_ids(routing: Routing) -> Tensor:
    """``[tokens, moe layers, top_k]`` int64 expert ids, -1 where not computed."""
    ids = np.frombuffer(routing.experts, dtype="<u2" if routing.wide else np.uint8)
    out = torch.from_numpy(ids.astype(np.int64)).view(-1, routing.num_layers, routing.top_k)
    return out.masked_fill_(out == routing.none, -1)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (modules named ``gate`` whose parent also
    holds ``experts``, as transformers' sparse MoE blocks do)."""
    return [m.gate for m in model.modules()
            if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), torch.nn.Module)]


def router_hooks(model: torch.nn.Module, *, replay: bool, compiled: bool,
                 source: object) -> RouterHooks | None:
    """The policy's router hooks (None for a dense or compiled model: a compiled forward does
    not count agreement, and the config refuses replay with ``train.compile``)."""
    if not routers(model):
        if replay:
            raise ValueError(f"train.routing_replay = replay needs a mixture-of-experts model; "
                             f"{source} has no experts")
        return None
    if compiled:
        return None
    return RouterHooks(model, replay=replay,
                       norm_topk=bool(getattr(model.config, "norm_topk_prob", False)))


def bound(hooks: RouterHooks | None, experts: Tensor,
          token_mask: Tensor) -> contextlib.AbstractContextManager[None]:
    """``hooks.bind(experts, token_mask)``, or nothing to bind (a dense model, the reference)."""
    return contextlib.nullcontext() if hooks is None else hooks.bind(experts, token_mask)


class RouterHooks:
    """Forward hooks on a model's routers: agreement counts, and replay when asked."""

    def __init__(self, model: torch.nn.Module, *, replay: bool, norm_topk: bool) -> None:
        self.replay, self.norm_topk = replay, norm_topk
        self.num_layers = 0
        self._bound: tuple[Tensor, Tensor] | None = None  # [N, layers, k] ids, [N] has one
        self.agree = self.total = 0  # (token, layer) pairs since the last take_counts()
        for layer, router in enumerate(routers(model)):
            router.register_forward_hook(self._hook(layer))
            self.num_layers += 1

    @contextlib.contextmanager
    def bind(self, experts: Tensor, token_mask: Tensor) -> Iterator[None]:
        """Route the forward passes inside by ``experts`` ([R, W, layers, k], -1: none) for
        the real tokens of ``token_mask`` [R, W] (and count agreement from zero); nothing
        bound when it holds no routing."""
        if experts.shape[-1] == 0:  # no sample of the micro-batch carries routing
            yield
            return
        if experts.shape[2] != self.num_layers:
            raise ValueError(f"recorded routing has {experts.shape[2]} layers with experts, "
                             f"the trainer's model {self.num_layers}: it was recorded by "
                             "another model")
        flat = experts.reshape(-1, *experts.shape[2:])
        self.agree = self.total = 0
        self._bound = (flat, token_mask.reshape(-1) & (flat >= 0).all(-1).all(-1))
        try:
            yield
        finally:
            self._bound = None

    def take_counts(self) -> tuple[int, int]:
        """(agreeing, recorded) (token, layer) pairs counted since the last call."""
        out = (self.agree, self.total)
        self.agree = self.total = 0
        return out

    def _hook(self, layer: int):  # a torch forward hook
        def hook(module: torch.nn.Module, args: tuple, out: tuple[Tensor, Tensor, Tensor]
                 ) -> tuple[Tensor, Tensor, Tensor] | None:
            if self._bound is None:
                return None
            logits, _, own = out
            recorded, has = self._bound[0][:, layer].to(own.device), self._bound[1]
            has = has.to(own.device)
            same = (own.sort(-1).values == recorded.sort(-1).values).all(-1)
            self.agree += int((same & has).sum())
            self.total += int(has.sum())
            if not self.replay:
                return None
            chosen = torch.where(has[:, None], recorded, own)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return hook

"""The shared-KV draft head in torch: the same computation as the exported ONNX graph
(:func:`ortspec.adapters.tools.drafter_graph.build_head_graph`), initialised from and written back to
:class:`~ortspec.adapters.tools.drafter_graph.HeadWeights`, so ``ortspec train-drafter`` trains exactly what it
exports. torch is imported only when a head is made."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ortspec.adapters.tools.drafter_graph import HeadWeights

FROZEN = ("lm_head", "cos", "sin")


def torch_head(weights: HeadWeights, kv_heads: int):
    """A ``torch.nn.Module`` computing :func:`ortspec.adapters.tools.drafter_graph.build_head_graph`'s head, initialised
    from ``weights`` (the LM head and RoPE tables as buffers). ``forward(embeds, states, positions, keys, values,
    allowed)``: ``embeds``/``states`` ``[B, Q, H]``, ``positions`` ``[B, Q]`` int64, ``keys``/``values``
    ``[B, kv_heads, L, D]`` (key index = position), ``allowed`` bool ``[B, Q, L]`` (which keys each query may read;
    a windowed head also drops those before ``position - window``) -> ``(logits [B, Q, V'], state [B, Q, H])``.
    ``layer(u, positions, keys, values, allowed)``: the copied layer and final norm alone, from the residual
    stream ``u``."""
    import torch
    from torch import nn

    class Head(nn.Module):
        # set in __init__ from weights.arrays() (parameters and buffers); declared for the type checker
        norm_embed: torch.Tensor
        norm_hidden: torch.Tensor
        fc: torch.Tensor
        fc_bias: torch.Tensor
        cos: torch.Tensor
        sin: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            for name, array in weights.arrays().items():
                tensor = torch.from_numpy(np.array(array, np.float32))
                if name in FROZEN:
                    self.register_buffer(name, tensor)
                else:
                    setattr(self, name, nn.Parameter(tensor))
            self.heads, self.size, self.eps, self.kv_heads = weights.heads, weights.head_size, weights.eps, kv_heads

        def rms(self, x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

        def forward(self, embeds, states, positions, keys, values, allowed):
            u = torch.cat([self.rms(embeds, self.norm_embed), self.rms(states, self.norm_hidden)], -1)
            state = self.layer(u @ self.fc + self.fc_bias, positions, keys, values, allowed)
            return state @ self.lm_head, state

        def layer(self, u, positions, keys, values, allowed):
            """The copied layer and the final norm on the residual stream ``u`` ``[B, Q, H]``: the state."""
            batch, queries, _ = u.shape
            q = (self.rms(u, self.norm_attn) @ self.wq).view(batch, queries, self.heads, self.size)
            if weights.q_norm is not None:
                q = self.rms(q, self.q_norm)
            q = q.transpose(1, 2)
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, Q, D/2]
            first, second = q.chunk(2, dim=-1)
            q = torch.cat([first * cos - second * sin, second * cos + first * sin], -1)
            group = self.heads // self.kv_heads
            k = keys.repeat_interleave(group, dim=1)
            v = values.repeat_interleave(group, dim=1)
            scores = (q @ k.transpose(-1, -2)) * weights.attention_scale
            if weights.softcap:
                scores = torch.tanh(scores / weights.softcap) * weights.softcap
            if weights.window:  # a query at position p reads positions >= p - window
                index = torch.arange(keys.shape[2])
                allowed = allowed & (index[None, None, :] >= positions[:, :, None] - weights.window)
            scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
            attended = torch.nan_to_num(scores.softmax(-1)) @ v  # a query allowed no key reads zeros
            u = u + self.join(attended.transpose(1, 2).reshape(batch, queries, -1) @ self.wo, "norm_post_attn")
            m = self.rms(u, self.norm_mlp)
            gate = m @ self.w_gate
            if weights.activation == "gelu_tanh":
                activated = nn.functional.gelu(gate, approximate="tanh")
            else:
                activated = nn.functional.silu(gate)
            u = u + self.join((activated * (m @ self.w_up)) @ self.w_down, "norm_post_mlp")
            return self.rms(u, self.norm_out)

        def join(self, x, norm: str):
            if getattr(weights, norm) is not None:
                x = self.rms(x, getattr(self, norm))
            return x * weights.residual_scale if weights.residual_scale != 1.0 else x

        def weights(self) -> HeadWeights:
            arrays = {name: getattr(self, name).detach().numpy().copy() for name in weights.arrays()}
            return attrs.evolve(weights, **arrays)

    return Head()


def fused_torch_head(head, layers: tuple[int, ...], eps: float):
    """``head`` (a :func:`torch_head`) whose first step reads fused features (``drafter_folder.FeatureFusion``'s
    computation): given a state ``[B, Q, (1 + L) * H]`` (a target hidden row: the final hidden state, then the
    residual streams entering ``layers``), it feeds ``fuse(rms(part) for each part)`` to ``head``; a state ``[B, Q,
    H]`` (the head's own, from the second step on) passes through. ``fuse`` (a ``[(1 + L) H, H]`` matrix and bias)
    starts as ``[I, 0, ..., 0]``, so the fused head starts as ``head``. ``weights()`` is the head's; ``fusion()`` the
    trained fuse as a ``FeatureFusion``."""
    import torch
    from torch import nn

    from ortspec.backends.onnx.drafter_folder import FeatureFusion

    hidden = int(head.norm_hidden.shape[0])
    parts = 1 + len(layers)

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head
            start = np.zeros((parts * hidden, hidden), np.float32)
            start[:hidden] = np.eye(hidden, dtype=np.float32)
            self.fuse_w = nn.Parameter(torch.from_numpy(start))
            self.fuse_b = nn.Parameter(torch.zeros(hidden))

        def forward(self, embeds, states, *rest):
            if states.shape[-1] != hidden:
                normed = [
                    part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps) for part in states.split(hidden, -1)
                ]
                states = torch.cat(normed, -1) @ self.fuse_w + self.fuse_b
            return self.head(embeds, states, *rest)

        def weights(self) -> HeadWeights:
            return self.head.weights()

        def fusion(self) -> FeatureFusion:
            weight, bias = self.fuse_w.detach().numpy().copy(), self.fuse_b.detach().numpy().copy()
            return FeatureFusion(tuple(layers), float(eps), weight, bias)

    return Fused()


def recipe_head(weights: HeadWeights, kv_heads: int, feature_layers: Sequence[int], eps: float):
    """The head ``ortspec train-drafter``'s recipe trains: :func:`torch_head` of ``weights``, its first step reading
    the fused features of ``feature_layers`` (:func:`fused_torch_head`, with the RMS norms' ``eps``) when any."""
    head = torch_head(weights, kv_heads)
    return fused_torch_head(head, tuple(feature_layers), eps) if feature_layers else head

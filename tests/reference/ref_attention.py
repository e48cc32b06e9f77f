"""The attention modules of latent diffusion / CogVideoX (seed 003), restated in plain PyTorch, with
random weights; each case saves weights ("w.<name>", the reference's parameter names), inputs
("in.<name>"), outputs ("out.y") and, for the transformer block, gradients ("grad.<name>") to a
safetensors file the C++ tests load into difftrain's modules. Deviation from the seed, as in
difftrain: a (B, Lk) boolean mask is a key-padding mask (the seed's commented-out code's meaning)."""
import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, glu=False, dropout=0.0):
        super().__init__()
        inner = int(dim * mult)
        project_in = GEGLU(dim, inner) if glu else nn.Sequential(nn.Linear(dim, inner), nn.GELU())
        self.net = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner, dim_out or dim))

    def forward(self, x):
        return self.net(x)


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner = dim_head * heads
        context_dim = context_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        h = self.heads
        if additional_tokens is not None:
            n_extra = additional_tokens.shape[1]
            x = torch.cat([additional_tokens, x], dim=1)
        q = self.to_q(x)
        context = x if context is None else context
        k, v = self.to_k(context), self.to_v(context)
        if n_times_crossframe_attn_in_self:
            n_cp = x.shape[0] // n_times_crossframe_attn_in_self
            k = k[::n_times_crossframe_attn_in_self].repeat_interleave(n_cp, dim=0)
            v = v[::n_times_crossframe_attn_in_self].repeat_interleave(n_cp, dim=0)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        if mask is not None and mask.dim() == 2:
            mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        if additional_tokens is not None:
            out = out[:, n_extra:]
        return self.to_out(out)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, dropout=0.0, context_dim=None, gated_ff=True, disable_self_attn=False):
        super().__init__()
        self.disable_self_attn = disable_self_attn
        self.attn1 = CrossAttention(dim, context_dim if disable_self_attn else None, n_heads, d_head, dropout)
        self.ff = FeedForward(dim, dropout=dropout, glu=gated_ff)
        self.attn2 = CrossAttention(dim, context_dim, n_heads, d_head, dropout)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, context=None):
        x = self.attn1(self.norm1(x), context=context if self.disable_self_attn else None) + x
        x = self.attn2(self.norm2(x), context=context) + x
        return self.ff(self.norm3(x)) + x


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels, n_heads, d_head, depth=1, context_dim=None, use_linear=False):
        super().__init__()
        inner = n_heads * d_head
        self.norm = nn.GroupNorm(32, in_channels, eps=1e-6)
        self.proj_in = nn.Linear(in_channels, inner) if use_linear else nn.Conv2d(in_channels, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner, n_heads, d_head, context_dim=context_dim) for _ in range(depth)])
        self.proj_out = nn.Linear(inner, in_channels) if use_linear else nn.Conv2d(inner, in_channels, 1)
        self.use_linear = use_linear

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = x.flatten(2).transpose(1, 2)
        if self.use_linear:
            x = self.proj_in(x)
        for block in self.transformer_blocks:
            x = block(x, context=context)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.transpose(1, 2).reshape(b, -1, h, w)
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


class LinearAttention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=32):
        super().__init__()
        self.heads = heads
        hidden = dim_head * heads
        self.to_qkv = nn.Conv2d(dim, hidden * 3, 1, bias=False)
        self.to_out = nn.Conv2d(hidden, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.to_qkv(x).reshape(b, 3, self.heads, -1, h * w).unbind(1)
        k = k.softmax(dim=-1)
        context = torch.einsum("bhdn,bhen->bhde", k, v)
        out = torch.einsum("bhde,bhdn->bhen", context, q)
        return self.to_out(out.reshape(b, -1, h, w))


class SpatialSelfAttention(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.norm = nn.GroupNorm(32, in_channels, eps=1e-6)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(in_channels, in_channels, 1) for _ in range(4))

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)
        k = k.reshape(b, c, h * w)
        w_ = torch.softmax(torch.bmm(q, k) * (int(c) ** (-0.5)), dim=2)
        h_ = torch.bmm(v.reshape(b, c, h * w), w_.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(h_)


def randomize(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def save_case(out, name, module, inputs, y, grads=None, options=None):
    tensors = {f"w.{k}": v.detach().contiguous() for k, v in module.state_dict().items()}
    tensors.update({f"in.{k}": v.contiguous() for k, v in inputs.items()})
    tensors["out.y"] = y.detach().contiguous()
    for k, v in (grads or {}).items():
        tensors[f"grad.{k}"] = v.detach().contiguous()
    save_file(tensors, str(out / f"attention_{name}.safetensors"), metadata={"options": json.dumps(options or {})})


def generate(out):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(11)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731

    m = CrossAttention(32, 24, heads=4, dim_head=8)
    randomize(m, g)
    x, ctx = rn(2, 7, 32), rn(2, 5, 24)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    save_case(out, "cross", m, {"x": x, "context": ctx, "mask": mask}, m(x, context=ctx, mask=mask))

    m = CrossAttention(32, heads=4, dim_head=8)
    randomize(m, g)
    x, extra = rn(4, 6, 32), rn(4, 2, 32)
    y = m(x, additional_tokens=extra, n_times_crossframe_attn_in_self=2)
    save_case(out, "self_extra_crossframe", m, {"x": x, "additional_tokens": extra}, y)

    for glu in (False, True):
        m = FeedForward(32, glu=glu)
        randomize(m, g)
        x = rn(2, 5, 32)
        save_case(out, f"ff_glu{int(glu)}", m, {"x": x}, m(x))

    m = BasicTransformerBlock(32, 4, 8, context_dim=24)
    randomize(m, g)
    x, ctx = rn(2, 10, 32).requires_grad_(), rn(2, 5, 24)
    y = m(x, context=ctx)
    weight = rn(*y.shape)
    (y * weight).sum().backward()
    grads = {"x": x.grad, "weight": weight}
    grads.update({f"p.{k}": p.grad for k, p in m.named_parameters()})
    save_case(out, "block", m, {"x": x.detach(), "context": ctx}, y, grads)

    for use_linear in (False, True):
        m = SpatialTransformer(32, 2, 16, depth=2, context_dim=24, use_linear=use_linear)
        randomize(m, g)  # proj_out too, so the test does not see the zero-initialised identity
        x, ctx = rn(2, 32, 4, 4), rn(2, 5, 24)
        save_case(out, f"spatial_linear{int(use_linear)}", m, {"x": x, "context": ctx}, m(x, context=ctx))

    m = LinearAttention(32, heads=4, dim_head=8)
    randomize(m, g)
    x = rn(2, 32, 4, 4)
    save_case(out, "linear", m, {"x": x}, m(x))

    m = SpatialSelfAttention(32)
    randomize(m, g)
    x = rn(2, 32, 4, 4)
    save_case(out, "spatial_self", m, {"x": x}, m(x))

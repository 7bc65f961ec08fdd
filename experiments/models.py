"""The two small pre-LN transformers of the training experiment (docs/reproduction.md).

Each attention module is timm-style (a fused `qkv` Linear without bias and `num_heads`), so
spectral_cond.torch finds it, corrects its W_Q, W_K, W_V (spectral_conditioning) and measures
kappa(J) at its real input X, the LayerNorm'd tokens of a pre-LN block (MATH.md §10).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    """softmax(c Q K^T + M) V per head, c = 1/sqrt(head_dim), M causal or none, then an output
    projection. The qkv weight's rows are [Q | K | V], each head's d rows contiguous."""

    def __init__(self, D: int, heads: int, causal: bool):
        super().__init__()
        if D % heads:
            raise ValueError(f"Attention: D = {D} is not a multiple of heads = {heads}")
        self.num_heads = heads
        self.head_dim = D // heads
        self.causal = causal
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return self.proj(a.transpose(1, 2).reshape(B, N, D))


class Block(nn.Module):
    """Pre-LN: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, D: int, heads: int, mlp: int, causal: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention(D, heads, causal)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, mlp), nn.GELU(), nn.Linear(mlp, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _init(model: nn.Module) -> None:
    """ViT-style initialisation: Linear and embedding weights ~ N(0, 0.02^2), biases 0,
    LayerNorm (1, 0)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    for name, p in model.named_parameters():
        if name in ("cls", "pos"):
            nn.init.normal_(p, std=0.02)


class ViT(nn.Module):
    """A ViT for 8 x 8 images: non-overlapping patch x patch patches, a class token, learned
    position embeddings, `depth` pre-LN blocks, a final LayerNorm and a linear head."""

    def __init__(self, D: int, depth: int, heads: int, mlp: int, patch: int = 2,
                 image: int = 8, classes: int = 10):
        super().__init__()
        if image % patch:
            raise ValueError(f"ViT: image side {image} is not a multiple of patch {patch}")
        self.patch = patch
        self.tokens = (image // patch) ** 2 + 1
        self.embed = nn.Linear(patch * patch, D)
        self.cls = nn.Parameter(torch.zeros(1, 1, D))
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, D))
        self.blocks = nn.ModuleList(Block(D, heads, mlp, causal=False) for _ in range(depth))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, classes)
        _init(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B, S, _ = images.shape
        p = self.patch
        x = images.reshape(B, S // p, p, S // p, p).permute(0, 1, 3, 2, 4).reshape(B, -1, p * p)
        x = torch.cat([self.cls.expand(B, -1, -1), self.embed(x)], dim=1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x[:, 0]))


class CharLM(nn.Module):
    """A causal character model: token and learned position embeddings, `depth` pre-LN blocks
    with causal attention, a final LayerNorm and a linear head over the vocabulary."""

    def __init__(self, vocab: int, context: int, D: int, depth: int, heads: int, mlp: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, D)
        self.pos = nn.Parameter(torch.zeros(1, context, D))
        self.blocks = nn.ModuleList(Block(D, heads, mlp, causal=True) for _ in range(depth))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab)
        _init(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

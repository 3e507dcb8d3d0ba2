"""A small decoder-only transformer in nanoGPT's shape (Karpathy, nanoGPT ``model.py``; GPT-2,
Radford et al. 2019): pre-LayerNorm blocks of causal self-attention and a GELU MLP, learned
positions, the token embedding tied to the output layer (docs/compiler.md §7)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "CausalSelfAttention", "MLP", "Block", "gpt", "lm_loss", "token_accuracy"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, ``[N, T, C]`` → ``[N, T, C]``: one linear layer to
    queries, keys and values (``C → 3C``), ``n_head`` heads of ``C / n_head`` channels through
    ``scaled_dot_product_attention(is_causal=True)`` (position t attends to 0 … t), dropout
    ``dropout`` on the attention weights while training, and the output projection ``C → C``
    followed by dropout."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.dropout = n_head, n_embd // n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.size(0), x.size(1)  # sizes, not unpacking: torch.fx cannot iterate a Proxy
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # [N, T, C] each
        q, k, v = (a.view(n, t, self.n_head, self.head_dim).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(  # [N, H, T, C/H]
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(n, t, self.n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``C → 4C`` → GELU (exact, erf) → ``4C → C`` → dropout, on ``[N, T, C]``."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token indices ``idx [N, T]`` (int64 in [0, vocab_size), T ≤ ``block_size``) → next-token
    logits ``[N, T, vocab_size]``: token embedding (``wte``) + learned position embedding
    (``wpe[:T]``), dropout, ``n_layer`` pre-LN Blocks, a final LayerNorm, and the output layer
    ``logits = ln_f(x) @ wte.weightᵀ`` (weights tied to the embedding, no bias; Press & Wolf 2017).

    Initialisation as nanoGPT's: every weight matrix and the embeddings N(0, 0.02²), the residual
    projections (``c_proj``) N(0, (0.02 / √(2·n_layer))²), biases 0, LayerNorms (1, 0).

    Raises:
        ValueError: ``n_embd`` not divisible by ``n_head``, a size < 1, ``dropout`` ∉ [0, 1)."""

    def __init__(self, *, vocab_size: int = 256, block_size: int = 128, n_layer: int = 6,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        sizes = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd)
        bad = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"gpt({', '.join(bad)}): sizes must be integers ≥ 1")
        if n_embd % n_head:
            raise ValueError(f"gpt(n_embd={n_embd}, n_head={n_head}): n_embd must be a multiple of "
                             f"n_head (each head has n_embd / n_head channels), e.g. n_head=4")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"gpt(dropout={dropout!r}): the dropout probability must lie in [0, 1)")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Parameter(torch.zeros(block_size, n_embd))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe[:idx.size(1)])  # [N, T, C]
        x = self.ln_f(self.blocks(x))
        return F.linear(x, self.wte.weight)  # [N, T, V]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``idx [N, T0]`` and ``max_new_tokens`` tokens sampled one by one from softmax(last
        logits / ``temperature``) (among the ``top_k`` largest), each seeing at most the last
        ``block_size`` tokens: ``[N, T0 + max_new_tokens]``, in the module's current mode
        (``eval()``: no dropout). Raises ValueError when ``temperature`` ≤ 0."""
        if temperature <= 0:
            raise ValueError(f"generate(temperature={temperature!r}): must be > 0 (e.g. 0.8)")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :] / temperature  # [N, V]
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # [N, 1]
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt(*, vocab_size: int = 256, block_size: int = 128, n_layer: int = 6, n_head: int = 4,
        n_embd: int = 128, dropout: float = 0.0) -> GPT:
    """A new GPT (see GPT). The defaults, a byte-level model for ``datasets.fortunes``: 6 layers
    of 4 heads, 128 channels, context 128, 1,239,040 parameters."""
    return GPT(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
               n_embd=n_embd, dropout=dropout)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss: cross-entropy of ``logits [N, T, V]`` against the next
    tokens ``targets [N, T]`` (int64), averaged over all N·T tokens (nats per token;
    perplexity = exp(loss))."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The share of the N·T positions whose most likely next token (argmax of ``logits [N, T,
    V]``) is the target ``targets [N, T]``: a 0-dim tensor in [0, 1] (``fit(metric_fn=)``)."""
    return (logits.argmax(dim=-1) == targets).float().mean()

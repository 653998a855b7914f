"""Tiny random-weight reward models written in their real on-disk formats, offline, for the
scorers' tests: a transformers CLIP directory (PickScore / CLIPScore), a CLIP vision tower with
the aesthetic head file, and an HPSv2.1 directory whose checkpoint comes from an independent
OpenCLIP-style module (nn.MultiheadAttention, x @ proj), so the renaming is checked against
OpenCLIP's own conventions rather than against its inverse."""

from __future__ import annotations

import math
import os
from collections import OrderedDict

import torch
from torch import nn

from tools.tiny_clip import tiny_clip_processor


def tiny_clip(processor, seed: int = 0, projection_dim: int = 16):
    from transformers import CLIPConfig, CLIPModel

    vocab = processor.tokenizer.get_vocab()
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"],
        ),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    return CLIPModel(cfg)


def write_tiny_clip_dir(d: str | os.PathLike, seed: int = 0) -> str:
    """The on-disk layout of a PickScore_v1 / openai CLIP directory."""
    proc = tiny_clip_processor()
    tiny_clip(proc, seed).save_pretrained(d)
    proc.save_pretrained(d)
    return str(d)


def write_tiny_aesthetic_dir(d: str | os.PathLike, seed: int = 0) -> str:
    """A tiny CLIP plus `sac+logos+ava1-l14-linearMSE.pth` sized for its projection."""
    from trainer.rewards.aesthetic import HEAD_FILE, AestheticHead

    write_tiny_clip_dir(d, seed)
    torch.manual_seed(seed + 1)
    head = AestheticHead(16)
    for p in head.parameters():  # the published init is ~0: spread it so scores differ visibly
        nn.init.normal_(p, std=0.5)
    torch.save(head.state_dict(), os.path.join(d, HEAD_FILE))
    return str(d)


class _Block(nn.Module):
    """OpenCLIP's ResidualAttentionBlock (pre-LN, fused in-projection, GELU MLP)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(width, 2 * width), gelu=nn.GELU(),
                                             c_proj=nn.Linear(2 * width, width)))

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Tower(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.resblocks = nn.ModuleList([_Block(width, heads) for _ in range(layers)])


class OpenClipLike(nn.Module):
    """A tiny CLIP with OpenCLIP's parameter names and forward (vision width 80 and text width 64:
    one head each at ViT-H-14's head widths)."""

    def __init__(self, vocab_size: int, image_size: int = 32, patch: int = 8, embed_dim: int = 16):
        super().__init__()
        vw, tw, grid = 80, 64, image_size // patch
        self.visual = nn.Module()
        self.visual.conv1 = nn.Conv2d(3, vw, patch, patch, bias=False)
        self.visual.class_embedding = nn.Parameter(torch.randn(vw) * 0.5)
        self.visual.positional_embedding = nn.Parameter(torch.randn(grid * grid + 1, vw) * 0.5)
        self.visual.ln_pre, self.visual.ln_post = nn.LayerNorm(vw), nn.LayerNorm(vw)
        self.visual.transformer = _Tower(vw, 2, 1)
        self.visual.proj = nn.Parameter(torch.randn(vw, embed_dim) * vw ** -0.5)
        self.token_embedding = nn.Embedding(vocab_size, tw)
        self.positional_embedding = nn.Parameter(torch.randn(77, tw) * 0.5)
        self.transformer = _Tower(tw, 2, 1)
        self.ln_final = nn.LayerNorm(tw)
        self.text_projection = nn.Parameter(torch.randn(tw, embed_dim) * tw ** -0.5)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        for m in self.modules():  # non-trivial norms, so a mis-mapped one shows
            if isinstance(m, nn.LayerNorm):
                nn.init.normal_(m.weight, 1.0, 0.3)
                nn.init.normal_(m.bias, 0.0, 0.3)

    def encode_image(self, x):
        v = self.visual
        x = v.conv1(x).flatten(2).transpose(1, 2)
        x = torch.cat([v.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + v.positional_embedding
        x = v.ln_pre(x)
        for b in v.transformer.resblocks:
            x = b(x)
        return nn.functional.normalize(v.ln_post(x[:, 0]) @ v.proj, dim=-1)

    def encode_text(self, ids):
        n = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:n]
        mask = torch.full((n, n), float("-inf")).triu(1)
        for b in self.transformer.resblocks:
            x = b(x, mask)
        x = self.ln_final(x)
        return nn.functional.normalize(x[torch.arange(ids.shape[0]), ids.argmax(dim=-1)] @ self.text_projection, dim=-1)


def write_tiny_hps_dir(d: str | os.PathLike, seed: int = 0) -> tuple[str, OpenClipLike, object]:
    """HPS_v2.1_compressed.pt ({"state_dict": OpenCLIP names}) + the tokenizer files.
    Returns (dir, the reference module, the tokenizer)."""
    from trainer.rewards.hpsv2 import CHECKPOINT_FILE

    proc = tiny_clip_processor()
    torch.manual_seed(seed)
    ref = OpenClipLike(len(proc.tokenizer.get_vocab())).eval()
    os.makedirs(d, exist_ok=True)
    torch.save({"state_dict": ref.state_dict()}, os.path.join(d, CHECKPOINT_FILE))
    proc.tokenizer.save_pretrained(d)
    return str(d), ref, proc.tokenizer

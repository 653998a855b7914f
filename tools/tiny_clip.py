"""A byte-level CLIP tokenizer and image processor built offline (no vocabulary download), for
the scorers' tests and for tools/bench.py --scorers. With no merges every byte is a token, so a
prompt tokenizes longer than with CLIP's real BPE (capped at 77 tokens either way)."""

from __future__ import annotations


def bytes_to_unicode() -> list[str]:
    # GPT-2 / CLIP byte-to-symbol table: printable bytes map to themselves, the rest above 255
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_clip_processor(size: int = 32):
    """A byte-level CLIP tokenizer (end-of-text is the largest id, as in CLIP) + image processor."""
    from transformers import CLIPProcessor, CLIPTokenizer

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: the PIL processor is the default one
        from transformers import CLIPImageProcessor as ImageProcessor

    symbols = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    return CLIPProcessor(
        image_processor=ImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=tok,
    )

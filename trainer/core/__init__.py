"""The bottom layer: names, dtype names, the weight manifest and the weights checksum.

Everything else in the package may import from here; nothing here imports from the rest of the
package (tests/test_layers.py holds the order). Kept free of framework imports beyond torch.
"""

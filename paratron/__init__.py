"""paratron: N-D parallel training of transformer language models on PyTorch.

Submodules are imported on use; importing ``paratron`` itself is cheap.
"""

__version__ = "0.1.0"

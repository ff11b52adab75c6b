"""Everything in tinygpt that exists only for speed. The teaching files (``layers.py``, ``model.py``) compute the
same values with plain PyTorch; this package only chooses how the products run.

- ``Linear`` (``onednn.py``): ``nn.Linear`` whose products run on oneDNN where that is exact: inference,
  frozen weights, and the large products of trained weights; the layers build every linear from it.
- ``OutputHead`` (``head.py``): the head's ``nn.Linear``, with its kernel choice (oneDNN, or BLAS into padded rows).
- ``head_cross_entropy`` (``head_loss.py``): the training loss fused with the head, without [N, V] logits.
- ``disabled`` (``switch.py``): ``with tinygpt.fast.disabled(): ...`` runs all of it as plain PyTorch;
  ``disabled("onednn")``, ``disabled("train")``, ``disabled("head")``, ``disabled("loss")`` switch off one part.

Why the speed lives here and how the layers reach it: docs/performance.md, "Where the speed lives". Each module's
docstring names the benchmark that measures it.
"""

from __future__ import annotations

from .head import OutputHead
from .head_loss import IGNORE_INDEX, head_cross_entropy
from .onednn import Linear, linear
from .switch import PARTS, disabled, is_enabled

__all__ = ["IGNORE_INDEX", "Linear", "OutputHead", "PARTS", "disabled", "head_cross_entropy", "is_enabled", "linear"]

"""Speculative decoding, split by job: ``drafting`` (proposers, draft models, the per-row controller, the engine's
``Drafter``) and ``acceptance`` (the greedy and sampled verification maths). This name re-exports both for imports
written before the split."""

from .acceptance import (accept_greedy, accept_sampled, residual_distribution,  # noqa: F401
                         target_probs, verify)
from .drafting import (DraftController, Drafter, DraftModel, DraftModels, LookupIndex,  # noqa: F401
                       check_draft_model, propose_lookup)

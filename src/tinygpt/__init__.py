"""tinygpt: a GPT-2-family decoder-only transformer written from first principles in PyTorch."""

from .config import PRESETS, GPTConfig, get_config
from .generation import generate_greedy
from .kv_cache import KVCache
from .layers import GELU, FeedForward, LayerNorm, MultiHeadAttention, TransformerBlock
from .model import DummyGPTModel, GPTModel
from .params import ParameterCount, count_parameters

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "DummyGPTModel",
    "FeedForward",
    "GELU",
    "GPTConfig",
    "GPTModel",
    "KVCache",
    "LayerNorm",
    "MultiHeadAttention",
    "ParameterCount",
    "TransformerBlock",
    "count_parameters",
    "generate_greedy",
    "get_config",
]

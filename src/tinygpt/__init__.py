"""tinygpt: a GPT-2-family decoder-only transformer written from first principles in PyTorch."""

from .config import PRESETS, GPTConfig, get_config
from .generation import GenerationConfig, GenerationResult, generate, generate_greedy, stream
from .layers import GELU, FeedForward, LayerNorm, MultiHeadAttention, RMSNorm, SwiGLU, TransformerBlock
from . import fast  # the speed-only kernels and their switch: tinygpt.fast.disabled()
from .rope import RotaryEmbedding, apply_rope
from .model import DummyGPTModel, GPTModel
from .inference.kv_cache import KVCache
from .params import ParameterCount, count_parameters
from .text_stream import generate_text, stream_text
from .checkpoint import load_checkpoint_tokenizer, load_model, save_model
from .tokenizer import (
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    GPT2VocabularyError,
    Tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

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
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rope",
    "TransformerBlock",
    "count_parameters",
    "BPETokenizer",
    "CharTokenizer",
    "GPT2Tokenizer",
    "GPT2VocabularyError",
    "Tokenizer",
    "gpt2_tokenizer",
    "load_checkpoint_tokenizer",
    "load_model",
    "load_tokenizer",
    "save_model",
    "train_tokenizer",
    "GenerationConfig",
    "GenerationResult",
    "generate",
    "generate_greedy",
    "generate_text",
    "stream",
    "stream_text",
    "get_config",
]

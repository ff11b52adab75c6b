"""The options of the commands that run a saved model (``generate``, ``chat``, ``serve``'s model) and of ``params``,
``verify``, ``convert`` and ``merge``, as dataclasses whose fields make the commands' flags
(``tinygpt.cli.common.add_options``), like ``TrainingOptions`` for ``train``. Torch-free.

The generation settings themselves (temperature, top-k, ...) are not repeated here: every field of
``tinygpt.generation.GenerationConfig`` becomes a flag of both commands (``cli.common.add_generation_options``), so
a setting added there appears on the command line without an edit here. The other commands' options live beside
what they set: ``training.options`` (``train``, ``prepare``), ``alignment.options`` (the fine-tuning commands),
``evaluation.options`` (``eval``), ``serving.options`` (``serve``), ``experiment_options`` (``experiment NAME``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import checks
from .checks import option, restated
from .config import PRESETS

DTYPES = ("auto", "float32", "bfloat16")  # = tinygpt.devices.DTYPES (this module stays torch-free)
DEVICE_HELP = "cpu, cuda or cuda:N"
DTYPE_HELP = "bfloat16 = bf16 autocast with float32 weights; auto = bf16 on a bf16-capable GPU, else float32"
WEIGHT_TYPES = ("float32", "bfloat16", "int8")  # = tinygpt.fast.weights.WEIGHT_TYPES (this module stays torch-free)
WEIGHTS_HELP = ("the linear layers' weights for inference: bfloat16 (half the bytes, oneDNN's bf16 kernel where the "
                "CPU has one) or int8 (a quarter: per-channel scales); embeddings, norms and activations stay float32")
MODEL_HELP = ("a tinygpt checkpoint, a Hugging Face GPT-2 folder, a hub name (gpt2, gpt2-medium, ...) or a .gguf "
              "file")


@dataclass
class ModelOptions:
    """The model a command runs, and where: one meaning on every command."""

    model: str = option(None, MODEL_HELP, metavar="DIR|HUBNAME", required=True)
    tokenizer_dir: str | None = option(None, "a saved tokenizer, or a folder with GPT-2's encoder.json + vocab.bpe "
                                             "(or vocab.json + merges.txt); default: the model's own, else "
                                             "$TINYGPT_GPT2_VOCAB, else tiktoken's cache", metavar="DIR")
    device: str | None = option(None, DEVICE_HELP, default_help="cuda when available")
    dtype: str = option("auto", DTYPE_HELP, choices=DTYPES)
    weights: str = option("float32", WEIGHTS_HELP, choices=WEIGHT_TYPES)

    def check(self) -> None:
        checks.choice("dtype", self.dtype, DTYPES)
        checks.choice("weights", self.weights, WEIGHT_TYPES)


@dataclass
class ServeModelOptions(ModelOptions):
    """``tinygpt serve``'s model (the server's own flags are ``serving.options.ServeOptions``)."""

    model: str = restated(ModelOptions, "model", None, help="a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a "
                                                            "hub name (gpt2, gpt2-medium, ...)")
    tokenizer_dir: str | None = restated(ModelOptions, "tokenizer_dir", None,
                                         help="a tokenizer to use instead of the model's own")


@dataclass
class ChatOptions(ModelOptions):
    """``tinygpt chat``: instructions on stdin, answers on stdout (with ``GenerationConfig``'s settings)."""

    model: str = option(None, "a fine-tuned model (tinygpt sft/dpo/ppo, a LoRA run's adapter folder too)",
                        metavar="DIR|HUBNAME", required=True)
    base: str | None = option(None, "with an adapter folder as --model: the base model to apply it to",
                              metavar="DIR|HUBNAME", default_help="the base the adapter names")
    stop: list[str] = option(None, "stop before this text (repeatable); escape sequences are decoded: \\n newline, "
                                   "\\t tab, \\\\ backslash, \\xHH, \\uHHHH (so --stop '\\n\\n' is a blank line); "
                                   "generation also stops at the end-of-text token", metavar="TEXT",
                             action="append", escapes=True, default_help=None)
    tool: bool = option(False, "let the answers call the calculator (<<4*12= -> 48>>, as tinygpt grpo trains)")

    def check(self) -> None:
        super().check()
        if any(not text for text in self.stop or ()):
            raise ValueError("--stop needs a non-empty text")


@dataclass
class GenerateOptions(ChatOptions):
    """``tinygpt generate``: continue one prompt (with ``GenerationConfig``'s settings)."""

    model: str = option(None, MODEL_HELP, metavar="DIR|HUBNAME", required=True)
    prompt: str | None = option(None, "the text to continue; - reads it from stdin", group="prompt", required=True)
    prompt_file: str | None = option(None, "read the text to continue from a UTF-8 file", metavar="PATH",
                                     group="prompt")
    stream: bool = option(True, "print the text as it is generated (default) or all at the end",
                          both_ways=True)
    draft: str | None = option(None, "a small model sharing --model's tokenizer that drafts for it (speculative "
                                     "decoding: --speculative-tokens K per step, default 4; the same text for "
                                     "greedy decoding, the same distribution when sampling)",
                               metavar="DIR|HUBNAME")


@dataclass
class ParamsOptions:
    """``tinygpt params``: the parameter count of a config (a preset or a .json file) or of a saved checkpoint."""

    config: str = option("gpt2-small", f"a preset ({', '.join(PRESETS)}) or a config .json file", group="source")
    model: str | None = option(None, "a saved tinygpt checkpoint: its config, and the tensors stored", metavar="DIR",
                               group="source")
    qkv_bias: bool = option(False, "count a bias on the fused QKV projection (+3D per layer)")
    tie_weights: bool = option(False, "share the head with the token embedding (-VD)")
    json: bool = option(False, "print JSON instead of a table")


@dataclass
class VerifyOptions:
    """``tinygpt verify``: the model's logits against a reference implementation's (``tinygpt.verify``)."""

    reference: str = option(None, "upstream = llms_from_scratch ch04 (the chapter's code), hf = Hugging Face "
                                  "transformers", flag="reference", choices=["upstream", "hf"])
    json: bool = option(False, "print JSON instead of a table")


GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")  # = tinygpt.interop.gguf's writers (this module stays torch-free)


@dataclass
class ConvertOptions:
    """``tinygpt convert``: one direction (the ``direction`` group), its output and, for GGUF, the weights' type."""

    from_hf: str | None = option(None, "import a Hugging Face GPT-2 folder or hub name", metavar="DIR|HUBNAME",
                                 group="direction", required=True)
    to_hf: str | None = option(None, "export a tinygpt checkpoint for transformers", metavar="DIR",
                               group="direction")
    from_gguf: str | None = option(None, "import a GGUF file (gpt2 or llama architecture)", metavar="FILE",
                                   group="direction")
    to_gguf: str | None = option(None, "write --model as one GGUF file for llama.cpp", metavar="OUT.gguf",
                                 group="direction")
    out: str | None = option(None, "the directory to write (each file replaced atomically; other files kept); with "
                                   "--from-hf, --to-hf and --from-gguf", metavar="DIR")
    model: str | None = option(None, "with --to-gguf: the tinygpt checkpoint (or Hugging Face GPT-2 folder) to "
                                     "export", metavar="DIR")
    type: str = option("f32", "with --to-gguf: the weights' type; norms, biases and positions stay f32",
                       choices=list(GGUF_TYPES))
    force: bool = option(False, "write into a folder that holds other files or another kind of model (its files are "
                                "kept; same-named ones replaced), or replace an existing .gguf file")


@dataclass
class MergeOptions:
    """``tinygpt merge``: fold a LoRA adapter into its base (``interop.pretrained.merge_adapter``)."""

    adapter: str = option(None, "an adapter folder (adapter_config.json + adapter_model.safetensors)", metavar="DIR",
                          required=True)
    base: str | None = option(None, "the base model", metavar="DIR|HUBNAME", default_help="the one the adapter names")
    out: str = option(None, "where to write the merged checkpoint", metavar="DIR", required=True)
    force: bool = option(False, "write into a folder that holds other files (they are kept)")

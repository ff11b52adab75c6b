"""The LoRA / QLoRA flags every fine-tuning stage takes (torch-free, so the CLI can show them cheaply).

``--lora-r`` switches LoRA on; the others only matter with it. ``tinygpt.lora`` says what each target adapts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import option

TARGET_NAMES = ("qkv", "out_proj", "ffn_in", "ffn_out", "gate", "up", "down")  # tinygpt.lora.TARGETS' keys


@dataclass
class LoRAOptions:
    lora_r: int | None = option(None, "train LoRA adapters of rank R instead of every weight (the base is frozen)",
                                metavar="R", default_help="off: full fine-tuning")
    lora_alpha: float = option(16.0, "LoRA's alpha: the update is scaled by alpha / r")
    lora_dropout: float = option(0.0, "dropout on the adapters' input")
    lora_targets: list[str] | None = option(None, "the linears to adapt (gate/up/down: SwiGLU models)",
                                            choices=TARGET_NAMES, default_help="qkv out_proj")
    quantize: str | None = option(None, "with --lora-r: hold the frozen base in 4-bit NormalFloat (QLoRA); nf4-dq "
                                  "also quantises its per-block scales to 8 bits", choices=("nf4", "nf4-dq"),
                                  default_help="off")

    def to_config(self):
        """The ``LoRAConfig`` these flags give, or None without ``--lora-r`` (``OptionError`` for a bad value)."""
        if self.lora_r is None:
            if self.quantize is not None:
                from .checks import OptionError

                raise OptionError("quantize", self.quantize, "needs lora_r: only a frozen base is quantised")
            return None
        from .lora import DEFAULT_TARGETS, LoRAConfig

        return LoRAConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=tuple(self.lora_targets or DEFAULT_TARGETS), quantize=self.quantize)

"""``python -m tinygpt.evaluation ARGS``: lm-eval's own command line (``lm_eval ARGS``) with the ``tinygpt`` model
registered and the shipped tasks on the include path (unless ``--include_path`` is given), e.g.

    python -m tinygpt.evaluation --model tinygpt --model_args path=DIR --tasks tinygpt_choice

lm-eval has no plugin hook for models from other packages: its registry knows a model once the module defining it
is imported, which is what this does before handing over.
"""

from __future__ import annotations

import sys


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import harness  # noqa: F401  (registers "tinygpt")
    from .task_files import TASKS_DIR

    if not any(arg == "--include_path" or arg.startswith("--include_path=") for arg in sys.argv[1:]):
        sys.argv += ["--include_path", str(TASKS_DIR)]
    cli_evaluate()


if __name__ == "__main__":
    main()

"""Write engine layouts for a trained drafter folder and print the lines that serve them.

    draftsmith-export outputs/distill-demo/drafter --format vllm,speculators
        [--target T] [--out DIR] [--dtype bfloat16] [--num-speculative-tokens N] [--overwrite]

Each layout goes to ``<out>/<format>/`` (``--out`` defaults to the drafter folder, where
``draftsmith-distill --export_format`` puts them), written atomically by the writers training
uses (``draftsmith.train.export.existing``); the layouts a kind writes are
``EXPORT_FORMATS_BY_KIND``'s (EAGLE-3: vllm, sglang, speculators; DFlash: vllm, speculators;
Medusa: vllm; P-EAGLE: speculators). The draft length and the target come from the folder's
``provenance.json`` unless given. For each folder the command prints the vLLM line (``vllm
serve``, and the CPU build's server module) or SGLang's launch line
(``draftsmith.train.export.launch``). A missing folder, a layout the kind cannot take or an
existing output is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.train.config import EXPORT_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith-export",
        description="Write vLLM / SGLang / speculators layouts of a trained drafter folder and "
        "print the lines that serve them.",
        epilog="example: draftsmith-export outputs/distill-demo/drafter --format "
        "vllm,speculators --dtype bfloat16",
    )
    parser.add_argument("drafter", help="the drafter folder train/distill.py wrote")
    parser.add_argument(
        "--format",
        required=True,
        help=f"layouts, a comma list of {', '.join(EXPORT_FORMATS)} (as the kind allows)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the target's folder or hub id as the engine is given it (default: the one the "
        "drafter was trained on, from provenance.json)",
    )
    parser.add_argument(
        "--out", default=None, help="folder to write <format>/ into (default: the drafter folder)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the written weights (default: the drafter's own)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft length of the launch lines (default: the trained one: EAGLE-3's unroll "
        "steps from provenance.json, P-EAGLE's depths, Medusa's heads, DFlash's block - 1)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing <out>/<format>/ folders"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from draftsmith.train.export.existing import export_existing

    args = build_parser().parse_args(argv)
    written = export_existing(
        args.drafter,
        [part.strip() for part in args.format.split(",") if part.strip()],
        out_root=args.out,
        target=args.target,
        num_speculative_tokens=args.num_speculative_tokens,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    for export in written:
        print(f"wrote {export.fmt}: {export.folder}")
        for engine, line in export.lines.items():
            print(f"  {engine}:")
            print(f"    {line}")
    return 0


if __name__ == "__main__":
    from draftsmith.decode.command_line import run_command

    sys.exit(run_command(main))

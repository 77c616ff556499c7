"""draftsmith: train speculative-decoding drafters, decode with them exactly, serve and measure.

The one package draftsmith installs. Its subpackages live in the repository's top-level
folders (``pyproject.toml`` maps them; this folder holds only the package's own face):

- ``draftsmith.decode`` (``decode/``): drafters, exact verification, the engine, measuring and
  the server. Inference never needs the training stack.
- ``draftsmith.train`` (``train/``): losses, objectives, the accelerate loop, checkpoints,
  exports, the frozen target, regeneration, ablations.
- ``draftsmith.data`` (``data/``): corpora, templates, packing, the offline target cache.
- ``draftsmith.scripts`` (``scripts/``): the ``draftsmith-*`` command lines.

Imports point down that list (scripts -> train -> decode -> data), never up.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("draftsmith")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

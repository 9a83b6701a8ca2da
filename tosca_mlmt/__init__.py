"""tosca-mlmt: hierarchical RL (feedback writer + solver) for reasoning with textual feedback."""

from pathlib import Path as _Path

from tosca_mlmt import checkout as _checkout

__version__ = "0.1.0"

# cli/, pipelines/ and configs/ of the checkout this package came from, not of the one an editable
# install names (tosca_mlmt/checkout.py)
_checkout.install(_Path(__file__).parent)

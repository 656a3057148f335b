"""normlab: controlled LayerNorm-vs-RMSNorm GPT-2 pretraining."""

from normlab.common import paths  # noqa: F401  (registers the config resolvers)

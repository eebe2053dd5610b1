"""Fused ops: importing this package registers every `torch.ops.fuser.*` op."""

from fuser.ops import rmsnorm  # noqa: F401
